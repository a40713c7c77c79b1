"""The shared secret of `hpcnft reward-server` and the `remote` term: a token sent as
`Authorization: Bearer <token>` with each request.

It never enters a config, run.h5, a log or a command line (process lists are world-readable):
the server reads it from --token-file (its first line; the file open to its owner alone) or
$HPCNFT_REWARD_TOKEN, a remote term from the environment variable its token_env names. A server
listening beyond loopback needs one, unless told --insecure-no-token. Every error is one line
naming where the token comes from, never the token."""
from __future__ import annotations

import hmac
import ipaddress
import os
import stat

from hpcnft.rewards.config import REWARD_TOKEN_ENV

MIN_TOKEN_CHARS = 16  # the server does not slow down guesses: a short token would be found
MAX_TOKEN_CHARS = 4096
MAKE_ONE = "python3 -c 'import secrets; print(secrets.token_urlsafe(32))'"
MISSING, REFUSED = "missing", "refused"


class TokenError(ValueError):
    """A token that cannot be read or used (one line, without the token)."""


def check_token(token: str, source: str) -> str:
    """`token` if it can go in a header: visible ASCII (no spaces, no control characters)."""
    if not all("!" <= char <= "~" for char in token):
        raise TokenError(f"{source}: the token must be printable ASCII without spaces")
    if len(token) > MAX_TOKEN_CHARS:
        raise TokenError(f"{source}: a token of more than {MAX_TOKEN_CHARS} characters")
    return token


def read_token_file(path: str) -> str:
    """The first line of `path`, stripped; TokenError where the file is open to group or others
    (checked on the opened file itself), empty or unreadable."""
    source = f"--token-file {path}"
    try:
        with open(path, "rb") as f:
            mode = stat.S_IMODE(os.fstat(f.fileno()).st_mode)
            if mode & 0o077:
                raise TokenError(f"{source}: open to group or others (mode {mode:04o}): chmod 600 {path}")
            line = f.readline(MAX_TOKEN_CHARS + 2)
    except OSError as e:
        raise TokenError(f"{source}: {e.strerror or e}") from None
    try:
        token = line.decode("ascii").strip()
    except UnicodeDecodeError:
        raise TokenError(f"{source}: the token must be printable ASCII without spaces") from None
    if not token:
        raise TokenError(f"{source}: empty; write the token on its first line (then chmod 600 {path})")
    return check_token(token, source)


def server_token(token_file: str | None, environ=os.environ) -> str | None:
    """The token a server requires: --token-file's, else $HPCNFT_REWARD_TOKEN's; None if neither."""
    if token_file is not None:
        token, source = read_token_file(token_file), f"--token-file {token_file}"
    else:
        token, source = environ.get(REWARD_TOKEN_ENV, "").strip(), f"${REWARD_TOKEN_ENV}"
        if not token:
            return None
        check_token(token, source)
    if len(token) < MIN_TOKEN_CHARS:
        raise TokenError(f"{source}: a token of {len(token)} characters is easily guessed; use at least "
                         f"{MIN_TOKEN_CHARS}, e.g. from {MAKE_ONE}")
    return token


def client_token(token_env: str, environ=os.environ) -> str | None:
    """The token a remote term sends: the value of the variable `token_env` names, stripped;
    None where token_env is empty or the variable unset or empty."""
    token = environ.get(token_env, "").strip() if token_env else ""
    return check_token(token, f"${token_env} (token_env)") if token else None


def is_loopback(host: str) -> bool:
    """Whether listening on `host` reaches this machine alone: 127.0.0.0/8, ::1 (IPv4-mapped
    too) or `localhost`. Any other name counts as reaching beyond: it may resolve anywhere."""
    if host.lower() == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    return (getattr(address, "ipv4_mapped", None) or address).is_loopback


def listening_refusal(host: str, token: str | None, insecure_no_token: bool) -> str | None:
    """Why a server may not listen on `host` as asked (one line), or None where it may."""
    if token is not None or insecure_no_token or is_loopback(host):
        return None
    return (f"--host {host} reaches beyond this machine: give a shared secret (--token-file or "
            f"{REWARD_TOKEN_ENV}), or --insecure-no-token to serve anyone")


def bearer(token: str) -> str:
    """The Authorization header's value for `token`."""
    return f"Bearer {token}"


def authorization(values: list[str], token: bytes) -> str | None:
    """None where a request's Authorization headers (`values`) carry `token`, else MISSING (none,
    or not a Bearer token) or REFUSED (another token, or several headers). Compared in constant time."""
    if not values:
        return MISSING
    scheme, _, credentials = str(values[0]).strip().partition(" ")
    if scheme.lower() != "bearer":
        return MISSING
    sent = credentials.strip().encode("latin-1", errors="replace")
    return None if hmac.compare_digest(sent, token) and len(values) == 1 else REFUSED
