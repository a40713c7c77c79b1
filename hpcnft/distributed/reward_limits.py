"""What the reward service takes in one chunk of images (reward_service checks each request
against these before it allocates anything; the remote terms' HTTP protocol too, and the config
refuses a rollout whose chunks would exceed them). No torch here: the config imports it."""
MAX_CHUNK = 4096  # images
MAX_SIDE = 8192  # pixels, height and width
MAX_CHUNK_BYTES = 1 << 30  # one chunk of uint8 images: 1 GiB (the recipe's 8 images of 512² are 6 MiB)
