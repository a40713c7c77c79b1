"""The output folder of `hpcnft export`: an existing one is refused unless the user says --force,
and then only if it holds nothing but what an export writes (an earlier export, or nothing), so
that a mistyped OUT never costs a run dir or other files. The export is written into a fresh
folder beside OUT and renamed into place once complete: a failed export leaves OUT as it was (or
absent), never half written. Its folder and files take their modes from the umask of the process
that writes them, as `cp` would (`_modes_of_the_umask`; docs/hardening.md says why)."""
from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil

# What `hpcnft export` writes: LoRA adapters (diffusers' save_lora_weights), or a transformer
# folder (save_pretrained: its config and one or more safetensors shards with their index).
EXPORT_FILE = re.compile(r"pytorch_lora_weights\.safetensors|config\.json"
                         r"|diffusion_pytorch_model(-\d+-of-\d+)?\.safetensors(\.index\.json)?")


def refusal(out: str, force: bool) -> str | None:
    """Why OUT may not be written, as one line, or None when it may."""
    if not os.path.lexists(out):
        return None
    if not force:
        return f"{out}: already exists; pass --force to replace it"
    if os.path.islink(out) or not os.path.isdir(out):
        return f"{out}: not a folder (a file or a link); --force replaces only an earlier export's folder"
    try:
        names = sorted(os.listdir(out))
    except OSError as e:
        return f"{out}: cannot read it ({e.strerror or e})"
    foreign = [n for n in names if not (EXPORT_FILE.fullmatch(n) and os.path.isfile(os.path.join(out, n)))]
    if foreign:
        return (f"{out}: holds {foreign[0]!r}, which no export writes; --force replaces only an earlier "
                "export (or an empty folder)")
    return None


@contextlib.contextmanager
def written_beside(out: str):
    """Yields a new empty folder beside OUT to write the export into. When the block ends without
    error the folder becomes OUT (an existing OUT is moved aside first and removed once the new
    one is in place); when it fails the folder is removed and OUT is untouched."""
    final = os.path.abspath(out)
    parent, name = os.path.split(final)
    os.makedirs(parent, exist_ok=True)
    # a hidden name on the same file system, so that the rename is one step
    new = os.path.join(parent, f".{name}.export-{os.getpid()}-{secrets.token_hex(4)}")
    os.mkdir(new)
    try:
        yield new
        _modes_of_the_umask(new)
        _swap_in(new, final)
    except BaseException:
        shutil.rmtree(new, ignore_errors=True)
        raise


def _modes_of_the_umask(folder: str) -> None:
    """Every file written into `folder` gets the mode the process's umask gives a new file, as the
    folder itself has: safetensors writes its files 0600 whatever the umask."""
    mask = os.umask(0)
    os.umask(mask)
    for entry in os.scandir(folder):
        if entry.is_file(follow_symlinks=False):
            os.chmod(entry.path, 0o666 & ~mask)


def _swap_in(new: str, final: str) -> None:
    if not os.path.lexists(final):
        os.rename(new, final)
        return
    aside = f"{new}.replaced"
    os.rename(final, aside)
    try:
        os.rename(new, final)
    except OSError:
        os.rename(aside, final)  # put the earlier export back
        raise
    shutil.rmtree(aside, ignore_errors=True)
