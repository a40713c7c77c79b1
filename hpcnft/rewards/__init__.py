"""Reward terms: the scorers the reward ranks serve (PickScore, HPSv2, CLIP score, aesthetic,
JPEG size, a remote HTTP scorer), each behind one call: prompts and uint8 images in, float32
scores out. registry.py maps a term's kind to its loader; base.py holds the contract."""
