"""The `ocr` reward term: how much of the prompt's double-quoted text the image shows, scored as
the official DiffusionNFT OCR reward scores it (the formula: hpcnft.rewards.ocr_text), the text
read by PP-OCRv4 through rapidocr-onnxruntime (the `ocr` extra; its wheel carries the ONNX
detection and recognition models) on the reward rank's CPU, or its GPU where onnxruntime's CUDA
provider is installed.

The recognizer is set up as the official code's `PaddleOCR(use_angle_cls=False, lang="en")`
(paddleocr 2.9.1) runs: the image as the array it is given (the official code passes the RGB
array, which PaddleOCR and RapidOCR both take as BGR), text detection on the image resized to at
most 960 pixels on its longer side whatever its size (`keep_the_detectors_limit`) with
PaddleOCR's DB settings (`PADDLE_SETTINGS`), the lines cut from the image as given (never first
shrunk), no angle classifier, recognition at height 48 in batches of 6, lines of confidence
below 0.5 dropped.
Where it still differs (the models, the runtime): docs/rewards.md.

Determinism: every ONNX Runtime session runs its graph sequentially on determinism.cpu_threads
threads (a fixed count, as torch's), OpenCV's resizes on as many, and on a GPU with cuDNN's
default (not timed) convolution algorithms and deterministic compute: a run's scores are the
same bits every time on one machine.

An image whose recognition raises (the recognizer fails on it) scores 0, the reference's
maximum penalty, and the chunk gives one warning (hpcnft.common.term_warnings), never a crash.
A prompt without double-quoted text is refused before a job starts (RewardConfig.check_prompts);
given one here, the term raises ValueError."""
from __future__ import annotations

import logging

import numpy as np
import torch

from hpcnft.common.errors import one_line
from hpcnft.common.term_warnings import warn
from hpcnft.rewards import ocr_text
from hpcnft.rewards.base import as_uint8_numpy

# PaddleOCR 2.9's defaults (tools/infer/utility.py: det_limit_side_len, det_limit_type,
# det_db_thresh, det_db_box_thresh, det_db_unclip_ratio, use_dilation, det_db_score_mode, the
# detector's NormalizeImage, rec_image_shape, rec_batch_num, drop_score), as RapidOCR's keywords;
# RapidOCR's own defaults differ (its detector upscales to 736 pixels on the shorter side).
# max_side_len: RapidOCR shrinks an image over 2000 px before anything else, PaddleOCR never
# (hpcnft's images are at most 8192 px a side).
PADDLE_SETTINGS = {
    "det_limit_side_len": 960, "det_limit_type": "max", "det_thresh": 0.3, "det_box_thresh": 0.6,
    "det_unclip_ratio": 1.5, "det_donot_use_dilation": True, "det_score_mode": "fast",
    "det_mean": [0.485, 0.456, 0.406], "det_std": [0.229, 0.224, 0.225],
    "rec_img_shape": [3, 48, 320], "rec_batch_num": 6, "text_score": 0.5, "use_cls": False,
    "max_side_len": 1 << 30,
}
CUDA = "CUDAExecutionProvider"
CPU = "CPUExecutionProvider"

log = logging.getLogger("hpcnft")


def providers(device: torch.device, available: list[str]) -> list:
    """ONNX Runtime's providers for `device`: CUDA where asked for and installed (onnxruntime-gpu),
    with cuDNN's default convolution algorithms (RapidOCR's exhaustive search picks by timing),
    else the CPU."""
    if device.type == "cuda" and CUDA in available:
        index = device.index if device.index is not None else 0
        return [(CUDA, {"device_id": index, "cudnn_conv_algo_search": "DEFAULT"}), CPU]
    return [CPU]


def session_options(threads: int):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.use_deterministic_compute = True
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.enable_cpu_mem_arena = False  # as RapidOCR: images of every size, no arena kept at the largest
    options.log_severity_level = 3  # errors only
    return options


def build_engine(device: torch.device, threads: int):
    """RapidOCR with PaddleOCR's settings, its detection and recognition sessions made here
    (session_options, providers)."""
    import cv2
    import onnxruntime as ort
    from rapidocr_onnxruntime import RapidOCR

    cv2.setNumThreads(threads)
    engine = RapidOCR(intra_op_num_threads=1, inter_op_num_threads=1, **PADDLE_SETTINGS)
    keep_the_detectors_limit(engine.text_det)
    chosen = providers(device, ort.get_available_providers())
    if device.type == "cuda" and chosen[0] == CPU:
        log.info("ocr: onnxruntime's CUDA provider is not installed here (onnxruntime-gpu): recognizing on the CPU")
    paths = model_paths()
    # RapidOCR's OrtInferSession wrappers, each given a session of ours
    for wrapper, section in ((engine.text_det.infer, "Det"), (engine.text_rec.session, "Rec")):
        wrapper.session = ort.InferenceSession(paths[section], sess_options=session_options(threads),
                                               providers=chosen)
    return engine


def keep_the_detectors_limit(detector) -> None:
    """Detection on the image resized to at most det_limit_side_len (960) px on its longer side,
    whatever its size, as PaddleOCR's DetResizeForTest does. RapidOCR's detector ignores its limit
    in `max` mode and picks 960, 1500 or 2000 px by the image's size: a large image was detected
    at twice the official scale, where large letters are lost."""
    from rapidocr_onnxruntime.ch_ppocr_det.utils import DetPreProcess

    def official(longer_side: int) -> DetPreProcess:
        return DetPreProcess(detector.limit_side_len, detector.limit_type, detector.mean, detector.std)

    detector.get_preprocess = official


def model_paths() -> dict[str, str]:
    """The ONNX models the rapidocr-onnxruntime wheel carries, by its config's section (Det:
    ch_PP-OCRv4_det_infer.onnx, Rec: ch_PP-OCRv4_rec_infer.onnx, Cls)."""
    from rapidocr_onnxruntime.main import DEFAULT_CFG_PATH
    from rapidocr_onnxruntime.utils import read_yaml, update_model_path

    config = update_model_path(read_yaml(str(DEFAULT_CFG_PATH)))
    return {section: config[section]["model_path"] for section in ("Det", "Rec", "Cls")}


def read(engine, image: np.ndarray) -> str:
    """The text `engine` reads in one uint8 [H, W, 3] image, its lines joined (ocr_text.recognized_text)."""
    result, _ = engine(image, use_cls=False)
    return ocr_text.recognized_text((text, confidence) for _, text, confidence in (result or []))


class OcrTerm:
    def __init__(self, engine, name: str = "ocr"):
        self.engine, self.name = engine, name

    def targets(self, prompts: list[str]) -> list[str]:
        out = []
        for i, prompt in enumerate(prompts):
            try:
                out.append(ocr_text.target(prompt))
            except ValueError as e:
                raise ValueError(f"reward term {self.name!r}: prompt {i + 1} has {e}: {prompt[:80]!r}") from None
        return out

    def read_all(self, images: np.ndarray) -> tuple[list[str | None], list[str]]:
        """The text of each image (None where recognition failed) and each failure, as one line."""
        texts, failures = [], []
        for image in images:
            try:
                texts.append(read(self.engine, image))
            except Exception as e:  # noqa: BLE001 - the reference scores a failed image 0 and goes on
                texts.append(None)
                failures.append(one_line(e))
        return texts, failures

    def __call__(self, prompts: list[str], images) -> torch.Tensor:
        images = as_uint8_numpy(images)
        if len(prompts) != len(images):
            raise ValueError(f"reward term {self.name!r}: {len(prompts)} prompts for {len(images)} images")
        wanted = self.targets(prompts)
        texts, failures = self.read_all(images)
        if failures:
            warn(f"reward term {self.name!r}: recognition failed on {len(failures)} of {len(images)} images, "
                 f"scored 0 (first: {failures[0]})")
        scores = [0.0 if text is None else ocr_text.reward(text, w) for text, w in zip(texts, wanted)]
        return torch.tensor(scores, dtype=torch.float32)


def load(term, cfg, device: torch.device) -> OcrTerm:
    """The recognizer of the `ocr` extra, on `device` where onnxruntime can use it, with the
    config's CPU thread count."""
    try:
        engine = build_engine(device, cfg.determinism.cpu_threads)
    except ImportError as e:
        raise ImportError(f"{e}; the ocr term needs the ocr extra: pip install 'hpcnft[ocr]'") from None
    return OcrTerm(engine, term.name or term.kind)
