"""The HTTP protocol between a `remote` reward term and a scoring server (`hpcnft reward-server`,
or any server that speaks it: GenEval, OCR or VLM judges in their own environments).

  POST <url>                   the term's scoring endpoint, e.g. http://host:8000/v1/score/ocr
       Content-Type: application/x-npz
       Authorization: Bearer <token>   (where the server requires a shared secret)
       body: an uncompressed .npz (numpy.savez) holding exactly two arrays, in C order:
         images   uint8 [n, H, W, 3]          (1 <= n <= 4096, 1 <= H, W <= 8192,
                                                n*H*W*3 <= 1 GiB)
         prompts  numpy unicode array [n]     (prompts[i] is scored against images[i];
                                                at most 4096 characters each)
  200  application/json {"scores": [n finite numbers]}
       Each score is the float32 score written as the shortest decimal of its float64 value
       (Python's repr), so float32(float64(text)) gives back the same bits.
  4xx / 5xx  application/json {"error": "one line"}
       400 bad request (not an npz of the two arrays above, wrong dtype or shape), 401 the
       token missing or wrong (with WWW-Authenticate: Bearer; 403 may say the same), 404 unknown
       term, 413 body too large, 500 the term failed, 503 / 429 busy, with a Retry-After of the
       seconds to wait (the client retries these).
  GET  /v1/health  ->  200 {"terms": [the names served], ...: a server may add its load}
       (with the same Authorization where the server requires a shared secret)

Nothing is ever unpickled: the server checks each array's npy header (dtype, shape, size, C
order) against the bounds above and then views the array in the body's own bytes, so a request
can neither run code nor make the server allocate more than its body holds."""
from __future__ import annotations

import io
import json
import math
import struct
import zipfile
import zlib

import numpy as np

from hpcnft.common.errors import first_line
from hpcnft.distributed.reward_limits import MAX_CHUNK, MAX_CHUNK_BYTES, MAX_SIDE

CONTENT_TYPE = "application/x-npz"
SCORE_PREFIX = "/v1/score/"
HEALTH_PATH = "/v1/health"
MAX_PROMPT_CHARS = 4096
# The images, the prompts at their longest (4 bytes a character), and room for the zip and npy headers.
MAX_BODY_BYTES = MAX_CHUNK_BYTES + MAX_CHUNK * MAX_PROMPT_CHARS * 4 + (1 << 20)
ARRAYS = ("images", "prompts")


class ProtocolError(ValueError):
    """A request or an answer that does not follow the protocol (one line)."""


def encode_request(prompts: list[str], images: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, images=np.ascontiguousarray(images, dtype=np.uint8), prompts=np.array(list(prompts), dtype=np.str_))
    return buf.getvalue()


def _check_images_header(shape: tuple, dtype: np.dtype) -> None:
    if dtype != np.uint8 or len(shape) != 4 or shape[3] != 3:
        raise ProtocolError(f"images: expected uint8 [n, H, W, 3], got {dtype} {list(shape)}")
    n, h, w, _ = shape
    if not (0 < n <= MAX_CHUNK and 0 < h <= MAX_SIDE and 0 < w <= MAX_SIDE and n * h * w * 3 <= MAX_CHUNK_BYTES):
        raise ProtocolError(f"images: {n} images of {h}x{w} is out of bounds (n <= {MAX_CHUNK}, "
                            f"sides <= {MAX_SIDE}, {MAX_CHUNK_BYTES >> 20} MiB in all)")


def _check_prompts_header(shape: tuple, dtype: np.dtype) -> None:
    if dtype.kind != "U" or len(shape) != 1:
        raise ProtocolError(f"prompts: expected a unicode array [n], got {dtype} {list(shape)}")
    if dtype.itemsize // 4 > MAX_PROMPT_CHARS:
        raise ProtocolError(f"prompts: longer than {MAX_PROMPT_CHARS} characters")


CHECKS = {"images": _check_images_header, "prompts": _check_prompts_header}
HEADER_READERS = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
NPY_HEADER_PEEK = 16 + 10000  # the magic, the header's length and numpy's largest header it reads
LOCAL_HEADER = struct.Struct("<4s22xHH")  # a zip member's local header: signature, ..., name and extra lengths


class _BufferFile(io.RawIOBase):
    """A read-only file over a buffer (bytes, an mmap), for zipfile: reads copy only what they read."""

    def __init__(self, buffer):
        super().__init__()
        self.view, self.pos = memoryview(buffer).cast("B"), 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, out) -> int:
        n = max(0, min(len(out), len(self.view) - self.pos))
        out[:n] = self.view[self.pos:self.pos + n]
        self.pos += n
        return n

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = max(0, offset + (0, self.pos, len(self.view))[whence])
        return self.pos

    def tell(self) -> int:
        return self.pos


def _member_data(view: memoryview, info: zipfile.ZipInfo, name: str) -> tuple[int, int]:
    """(start, end) of a stored member's bytes in the body, from its local header."""
    start = info.header_offset
    head = bytes(view[start:start + LOCAL_HEADER.size])
    if len(head) != LOCAL_HEADER.size or not head.startswith(b"PK\3\4"):
        raise ProtocolError(f"{name}: not a readable npz member")
    _, name_len, extra_len = LOCAL_HEADER.unpack(head)
    start += LOCAL_HEADER.size + name_len + extra_len
    if start + info.file_size > len(view):
        raise ProtocolError(f"{name}: the npz member runs past the end of the body")
    return start, start + info.file_size


def _read_array(body, view: memoryview, archive: zipfile.ZipFile, name: str) -> np.ndarray:
    """One stored (uncompressed) member as an array over the body's own bytes (no copy): its npy
    header checked first, its data then viewed with numpy (never unpickled: only uint8 and
    unicode dtypes pass the header checks)."""
    info = archive.getinfo(f"{name}.npy")
    if info.compress_type != zipfile.ZIP_STORED:
        raise ProtocolError(f"{name}: compressed; send an uncompressed npz (numpy.savez)")
    start, end = _member_data(view, info, name)
    f = io.BytesIO(bytes(view[start:min(end, start + NPY_HEADER_PEEK)]))
    try:
        version = np.lib.format.read_magic(f)
        if version not in HEADER_READERS:
            raise ProtocolError(f"{name}: npy format version {version} (numpy.savez writes 1.0 or 2.0)")
        shape, fortran_order, dtype = HEADER_READERS[version](f)
    except ValueError as e:
        raise ProtocolError(f"{name}: not an npy array ({e})") from None
    CHECKS[name](shape, dtype)
    if fortran_order and len(shape) > 1:
        raise ProtocolError(f"{name}: in Fortran order; send a C-ordered array (numpy.savez of "
                            "np.ascontiguousarray)")
    data_bytes = math.prod(shape) * dtype.itemsize
    if end - start - f.tell() != data_bytes:
        raise ProtocolError(f"{name}: holds {end - start - f.tell()} data bytes, its header says {data_bytes}")
    if zlib.crc32(view[start:end]) != info.CRC:
        raise ProtocolError(f"{name}: bad CRC-32 (the npz member is damaged)")
    try:
        return np.frombuffer(body, dtype=dtype, count=math.prod(shape), offset=start + f.tell()).reshape(shape)
    except ValueError as e:
        raise ProtocolError(f"{name}: unreadable ({e})") from None


def decode_request(body) -> tuple[list[str], np.ndarray]:
    """An npz request body (bytes, or any buffer: the server's is an mmap) -> (prompts, images
    uint8 [n, H, W, 3] C-contiguous, a view of the body's bytes); ProtocolError if it is
    anything else. The images hold no memory of their own: a request costs its body once."""
    view = memoryview(body).cast("B")
    try:
        archive = zipfile.ZipFile(_BufferFile(view))
    except (zipfile.BadZipFile, ValueError) as e:
        raise ProtocolError(f"the body is not an npz file ({e})") from None
    with archive:
        names = sorted(archive.namelist())
        if names != sorted(f"{a}.npy" for a in ARRAYS):
            raise ProtocolError(f"expected exactly the arrays {', '.join(ARRAYS)}, got {', '.join(names) or 'none'}")
        try:
            arrays = {name: _read_array(body, view, archive, name) for name in ARRAYS}
        except (zipfile.BadZipFile, EOFError, OSError) as e:
            raise ProtocolError(f"the body is not a readable npz file ({e})") from None
    images, prompts = arrays["images"], arrays["prompts"]
    if len(prompts) != len(images):
        raise ProtocolError(f"{len(prompts)} prompts for {len(images)} images")
    return [str(p) for p in prompts], np.ascontiguousarray(images)


def encode_scores(scores: np.ndarray) -> bytes:
    """float32 [n] -> the JSON answer. A float32 widened to float64 is exact, and json writes a
    float64 as its shortest round-tripping decimal."""
    values = [float(x) for x in np.asarray(scores, dtype=np.float32).reshape(-1)]
    if not all(math.isfinite(v) for v in values):
        raise ProtocolError("the term returned scores that are not finite")
    return json.dumps({"scores": values}).encode()


def _refuse_constant(name: str):
    raise ProtocolError(f"a score of {name}")


def decode_scores(body: bytes, n: int) -> np.ndarray:
    """The JSON answer -> float32 [n]; ProtocolError unless it holds n finite numbers."""
    try:
        answer = json.loads(body, parse_constant=_refuse_constant)
    except ProtocolError:
        raise
    except ValueError as e:  # UnicodeDecodeError included
        raise ProtocolError(f"not JSON ({first_line(e)})") from None
    scores = answer.get("scores") if isinstance(answer, dict) else None
    if not isinstance(scores, list):
        raise ProtocolError('no "scores" list')
    if len(scores) != n:
        raise ProtocolError(f"{len(scores)} scores for {n} images")
    if not all(isinstance(s, (int, float)) and not isinstance(s, bool) for s in scores):
        raise ProtocolError("scores that are not numbers")
    try:
        with np.errstate(over="ignore"):  # beyond float32 becomes inf, refused below
            out = np.array([float(s) for s in scores], dtype=np.float64).astype(np.float32)
    except OverflowError:  # an integer beyond float64
        raise ProtocolError("scores that are not finite float32 numbers") from None
    if not np.isfinite(out).all():
        raise ProtocolError("scores that are not finite float32 numbers")
    return out


def error_body(text: str) -> bytes:
    return json.dumps({"error": text}).encode()


def error_text(body: bytes) -> str:
    """The `error` of an error answer, else the start of whatever the body holds."""
    try:
        answer = json.loads(body)
    except ValueError:
        answer = None
    if isinstance(answer, dict) and isinstance(answer.get("error"), str):
        return first_line(ProtocolError(answer["error"]))
    return " ".join(body[:200].decode("utf-8", errors="replace").split())
