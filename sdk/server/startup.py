"""What `dayzero serve` checks before the model loads, so that a bad start fails in seconds.

In order: the flags' values and files (`check_flags`, no torch), the port (`bind`: taken at once,
listened on only once the model is up), the names that need their registries (`check_names`),
and, once the tokenizer is read but before any weight, the chat template rendered on a probe
conversation (`probe_template`). Each failure is a ValueError naming the flag and what it wants.
"""

from __future__ import annotations

import argparse
import errno
import ipaddress
import logging
import socket
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger("dayzero.server")

PROBE_CONVERSATION = [{"role": "user", "content": "Hello! Can you hear me?"}]


def parse_size(text: str) -> int:
    """Bytes from `512`, `64MiB`, `2G`, `1.5GiB` (powers of 1024)."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    if t and t[-1] in units:
        return int(float(t[:-1]) * units[t[-1]])
    return int(t)


def parse_gib(text: str) -> int:
    """vLLM's --swap-space: a plain number is GiB; with a unit, that unit."""
    try:
        return int(float(text) * (1 << 30))
    except ValueError:
        return parse_size(text)


def _size(flag: str, text: str, parse: Callable[[str], int] = parse_size) -> int:
    try:
        value = parse(text)
    except (ValueError, OverflowError):  # not a number, or inf
        raise ValueError(f"{flag} {text}: not a size (bytes, or with a unit: 512MiB, 2GiB)") from None
    if value < 0:
        raise ValueError(f"{flag} {text}: must not be negative")
    return value


def check_flags(args: argparse.Namespace) -> str | None:
    """Every flag value and file `serve` reads, checked without loading anything; returns the
    --chat-template file's text (None: the checkpoint's own template)."""
    at_least = {
        "--max-num-seqs": (args.max_num_seqs, 1),
        "--max-num-batched-tokens": (args.max_num_batched_tokens, 1),
        "--max-waiting": (args.max_waiting, 1),
        "--max-model-len": (args.max_model_len, 1),
        "--chunked-prefill-size": (args.chunked_prefill_size, 1),
        "--port": (args.port, 0),
        "--tokenizer-workers": (getattr(args, "tokenizer_workers", None), 1),
        "--tokenizer-queue": (getattr(args, "tokenizer_queue", None), 0),
    }
    for flag, (value, low) in at_least.items():
        if value is not None and value < low:
            raise ValueError(f"{flag} {value}: must be at least {low}")
    if args.port > 65535:
        raise ValueError(f"--port {args.port}: a port is at most 65535")
    if not 0 < args.gpu_memory_utilization <= 1:
        raise ValueError(f"--gpu-memory-utilization {args.gpu_memory_utilization}: a fraction in (0, 1]")
    if not args.shutdown_timeout >= 0:
        raise ValueError(f"--shutdown-timeout {args.shutdown_timeout}: seconds, at least 0")
    if args.kv_cache_memory is not None and _size("--kv-cache-memory", args.kv_cache_memory) == 0:
        raise ValueError(f"--kv-cache-memory {args.kv_cache_memory}: leaves no memory for the KV cache")
    _size("--swap-space", args.swap_space, parse_gib)
    if _size("--max-request-bytes", args.max_request_bytes) == 0:
        raise ValueError(f"--max-request-bytes {args.max_request_bytes}: must be at least 1")
    if args.served_model_name is not None and not args.served_model_name.strip():
        raise ValueError("--served-model-name: empty")
    if args.chat_template is None:
        return None
    path = Path(args.chat_template)
    if not path.is_file():
        raise ValueError(f"--chat-template {path}: no such file")
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--chat-template {path}: cannot be read ({e})") from None


def check_names(args: argparse.Namespace) -> None:
    """The flags whose valid values live in a registry (torch is imported by now)."""
    import torch

    from dayzero.sdk.api import check_model_path, parse_dtype
    from dayzero.sdk.families import FAMILIES
    from dayzero.sdk.server.tools import TOOL_PARSERS

    if args.model is not None:
        check_model_path(args.model)
    if args.family is not None and args.family not in FAMILIES:
        raise ValueError(f"--family {args.family}: no such family; known: {', '.join(FAMILIES.keys())}")
    if args.tool_call_parser is not None and args.tool_call_parser not in TOOL_PARSERS:
        known = ", ".join(TOOL_PARSERS.keys())
        raise ValueError(f"--tool-call-parser {args.tool_call_parser}: no such parser; known: {known}")
    if args.device is not None:
        try:
            kind = torch.device(args.device).type
        except RuntimeError:
            raise ValueError(f"--device {args.device}: not a device (cpu, cuda, cuda:N)") from None
        if kind == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"--device {args.device}: no CUDA device is visible to torch")
        if kind not in ("cpu", "cuda"):
            raise ValueError(f"--device {args.device}: dayzero serves on cpu or cuda")
    try:
        parse_dtype(args.dtype, torch.device("cpu"))
    except ValueError as e:
        raise ValueError(f"--dtype: {e}") from None


def url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port), not yet listening: the port is ours before the model
    loads, and clients get 'connection refused' (not a hung connection) until it serves."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as e:
        raise ValueError(f"--host {host}: cannot be resolved ({e.strerror})") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart within TIME_WAIT
    if family == socket.AF_INET6:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {url(host, port)}: {_why(e)}") from None
    return sock


def listen(sock: socket.socket, host: str, backlog: int = 2048) -> None:
    """Start listening (another process may have bound the port meanwhile: SO_REUSEADDR)."""
    try:
        sock.listen(backlog)
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {url(host, sock.getsockname()[1])}: {_why(e)}") from None


def _why(e: OSError) -> str:
    if e.errno == errno.EADDRINUSE:
        return "the port is in use (another server?); stop it or pick another --port"
    if e.errno == errno.EACCES:
        return "permission denied (ports below 1024 need privileges); pick another --port"
    if e.errno == errno.EADDRNOTAVAIL:
        return "no interface of this machine has that address; check --host"
    return e.strerror or str(e)


def is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to any interface
        return False


def warn_if_open(host: str, api_keys: tuple[str, ...]) -> None:
    if not api_keys and not is_loopback(host):
        log.warning(
            "listening on %s without an API key: anyone who can reach this port can run the model "
            "(and use its compute); pass --api-key KEY or set DAYZERO_API_KEY",
            host,
        )


def probe_template(tokenizer: PreTrainedTokenizerBase, template: str | None) -> None:
    """Render the chat template (--chat-template, else the checkpoint's) on a probe conversation,
    as a chat request renders it: a template that cannot is a start-up error, not a 400 later."""
    own = getattr(tokenizer, "chat_template", None)
    if template is None and not own:
        log.info("the checkpoint has no chat template: chat completions answer 400 (see --chat-template)")
        return
    try:
        tokenizer.apply_chat_template(
            PROBE_CONVERSATION, chat_template=template, add_generation_prompt=True, tokenize=False
        )
    except Exception as e:  # jinja2 syntax or render errors, or the template's raise_exception
        where = "--chat-template" if template is not None else "the checkpoint's chat template"
        fix = "" if template is not None else " (pass a working one with --chat-template)"
        why = f"{type(e).__name__}: {e}"
        raise ValueError(f"{where} cannot render a one-message probe conversation: {why}{fix}") from None
