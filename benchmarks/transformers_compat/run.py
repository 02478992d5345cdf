"""Run transformers' own checkpoint and resume tests twice, with the stock ``Trainer`` and with
``DynaQuantTrainer`` in its place, and print pass/fail per test for both.

    PYTHONPATH=$PWD python benchmarks/transformers_compat/run.py [--markdown OUT.md] [-k EXPR]

Each run is a separate pytest process (the substitution happens at import time, see
``tests/conftest.py``); results are read from pytest's JUnit XML. The Hub is kept offline
(``HF_HUB_OFFLINE=1``): tests that download a model fail the same way for both.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent
VARIANTS = {"Trainer": "stock", "DynaQuantTrainer": "dynaquant"}


def run_variant(variant: str, extra: list[str]) -> dict[str, tuple[str, str]]:
    """``{test id: (outcome, first line of the reason)}`` for one pytest run."""
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "junit.xml"
        env = {**os.environ, "HF_DYNAQUANT_COMPAT_TRAINER": variant, "HF_HUB_OFFLINE": "1"}
        cmd = [sys.executable, "-m", "pytest", str(HERE / "tests"), "-q", "-p", "no:randomly", f"--junitxml={xml}"]
        subprocess.run(cmd + extra, cwd=HERE, env=env, check=False)
        results = {}
        for case in ET.parse(xml).getroot().iter("testcase"):
            name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
            outcome, reason = "pass", ""
            for tag in ("failure", "error", "skipped"):
                node = case.find(tag)
                if node is not None:
                    outcome = {"failure": "FAIL", "error": "ERROR", "skipped": "skip"}[tag]
                    reason = (node.get("message") or "").strip().splitlines()[0][:110] if node.get("message") else ""
                    break
            results[name] = (outcome, reason)
        return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", type=Path, help="also write the table to this file")
    parser.add_argument("-k", dest="keyword", help="pytest -k expression")
    args = parser.parse_args()
    extra = ["-k", args.keyword] if args.keyword else []
    runs = {label: run_variant(variant, extra) for label, variant in VARIANTS.items()}
    names = sorted(set().union(*runs.values()))
    lines = ["| test | Trainer | DynaQuantTrainer | DynaQuantTrainer failure |", "|---|---|---|---|"]
    for name in names:
        stock, ours = (runs[label].get(name, ("-", "")) for label in VARIANTS)
        lines.append(f"| {name} | {stock[0]} | {ours[0]} | {ours[1] if ours[0] in ('FAIL', 'ERROR') else ''} |")
    for label, results in runs.items():
        counts = {k: sum(1 for o, _ in results.values() if o == k) for k in ("pass", "FAIL", "ERROR", "skip")}
        lines.append(f"\n{label}: " + ", ".join(f"{v} {k}" for k, v in counts.items()) + f" of {len(results)}")
    table = "\n".join(lines)
    print(table)
    if args.markdown:
        args.markdown.write_text(table + "\n")


if __name__ == "__main__":
    main()
