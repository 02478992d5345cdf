"""What a compressed folder or store holds, for people: the table ``hf-dynaquant inspect`` prints.

Shared by the command line (:mod:`hf_dynaquant.cli`) and the offline demo (:mod:`hf_dynaquant.demo`),
which both print it; it lives here so neither imports the other.
"""

from __future__ import annotations

from pathlib import Path

from .core.quantizer import read_config_record
from .pretrained.folder import MODEL_REF, find_store
from .pretrained.weights import describe_pretrained

__all__ = ["human_bytes", "inspect_table", "search_lines"]


def human_bytes(n: float) -> str:
    """A byte count for people: ``512 B``, ``1.23 MB`` (powers of 1000)."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    raise AssertionError


def inspect_table(path: str | Path, ref: str = MODEL_REF, limit: int | None = None) -> str:
    """The per-tensor table that ``hf-dynaquant inspect`` prints."""
    store = find_store(path)
    lines = []
    refs = store.refs()
    lines.append(
        f"store {store.path}: {len(store.entries())} entr{'y' if len(store.entries()) == 1 else 'ies'}, refs: "
        + (", ".join(f"{k} -> {v[:12]}" for k, v in refs.items()) or "none")
    )
    with store.open(ref) as entry:
        chain = store.chain(entry.id)
        lines.append(f"entry {entry.id[:16]} ({'keyframe' if entry.base is None else f'delta, chain of {len(chain)}'})")
        if entry.metadata.get("pretrained") is not None:
            lines.append("residuals against pre-trained weights " + describe_pretrained(entry.metadata["pretrained"]))
        lines.extend(search_lines(entry.metadata.get("search")))
        rows = []
        for section, name, rec in entry.tensor_records():
            after = sum(b["nbytes"] for b in rec.get("blobs", {}).values())
            before = rec.get("raw_nbytes", 0)
            codec = (
                f"alias of {rec['alias_of']}"
                if "alias_of" in rec
                else rec["codec"] + (" (delta)" if rec["uses_base"] else "")
            )
            rows.append(
                (
                    f"{section}:{name}" if len(entry.sections) > 1 else name,
                    rec["dtype"],
                    "x".join(map(str, rec["shape"])) or "scalar",
                    codec,
                    before,
                    after,
                )
            )
        for name in entry.extras:
            info = entry.manifest["extras"][name]
            rows.append(
                (f"extra:{name}", "bytes", str(info["size"]), info["coding"], int(info["size"]), int(info["nbytes"]))
            )
    width = max([len(r[0]) for r in rows] + [6])
    lines.append(
        f"{'tensor':<{width}}  {'dtype':<8} {'shape':<14} {'codec':<18} {'before':>10} {'after':>10} {'ratio':>7}"
    )
    shown = rows if limit is None else sorted(rows, key=lambda r: -r[4])[:limit]
    for name, dtype, shape, codec, before, after in shown:
        ratio = f"{before / after:.3f}" if after else "-"
        sizes = f"{human_bytes(before):>10} {human_bytes(after):>10} {ratio:>7}"
        lines.append(f"{name:<{width}}  {dtype:<8} {shape:<14} {codec:<18} {sizes}")
    if limit is not None and len(rows) > limit:
        lines.append(f"... {len(rows) - limit} more tensors (all of them: hf-dynaquant inspect PATH)")
    before, after = sum(r[4] for r in rows), sum(r[5] for r in rows)
    info = store.info(ref)
    lines.append(
        f"{'total':<{width}}  {len(rows)} tensors{'':<29} {human_bytes(before):>10} {human_bytes(after):>10} "
        f"{before / max(after, 1):7.3f}"
    )
    lines.append(f"on disk (with manifest and headers): {human_bytes(info.nbytes)}, ratio {info.ratio:.3f}x")
    return "\n".join(lines)


def search_lines(record: dict | None) -> list[str]:
    """The configuration search's record of an entry, for ``inspect`` (with the key names of any
    version: see :func:`~hf_dynaquant.core.quantizer.read_config_record`)."""
    if not record:
        return []
    chosen = record.get("config")
    chosen = None if chosen is None else read_config_record(chosen)
    head = f"search: {record['mode']}, {record['evaluations']} evaluations; "
    if chosen is None:
        head += "nothing passed, stored losslessly"
    else:
        head += (
            f"chosen bins={chosen['bins']} prune={chosen['prune']} protect={chosen['protect']} "
            f"prune_by={chosen['prune_by']} embedding_bins={chosen['embedding_bins']} "
            f"residual={chosen.get('residual', 'none')}, "
            f"degradation {record['degradation']:.3%} (baseline {record['baseline']:.4g})"
        )
    out = [
        head,
        f"  {'bins':>4} {'prune':>5} {'protect':>7} {'prune_by':<11} {'residual':<10} {'degradation':>11} {'bits':>6}  "
        "passed",
    ]
    for c in map(read_config_record, record["candidates"]):
        out.append(
            f"  {c['bins']:>4} {c['prune']:>5} {c['protect']:>7} {c['prune_by']:<11} {c.get('residual', 'none'):<10} "
            f"{c['degradation']:>11.3%} {c['bits']:>6.2f}  {'yes' if c['passed'] else 'no'}"
        )
    return out
