"""Write the decode-kernel variants `bench/moe.py --tune-decode` chose (its JSON's `best`) into
runtime/gpu/moe_gemv.py's DECODE_GEMV, so a later run in the same session uses them:
`python3 bench/apply_tuning.py $OUT/moe_tune_decode.json`."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

MODULE = Path(__file__).resolve().parents[1] / "runtime" / "gpu" / "moe_gemv.py"


def main() -> int:
    doc = json.loads(Path(sys.argv[1]).read_text())
    best = (doc.get("tune_decode") or doc).get("best") or {}
    text = MODULE.read_text()
    m = re.search(r"^DECODE_GEMV: dict\[str, str \| None\] = \{.*?\}\n", text, flags=re.M | re.S)
    if m is None:
        print("DECODE_GEMV not found", file=sys.stderr)
        return 1
    current = dict(re.findall(r'"(\w+)": (None|"\w+")', m.group(0)))
    table = {k: (None if v == "None" else v.strip('"')) for k, v in current.items()}
    table.update({k: (None if v == "dot" else v) for k, v in best.items()})
    body = ", ".join(f'"{k}": {"None" if v is None else repr(v).replace(chr(39), chr(34))}' for k, v in table.items())
    MODULE.write_text(text[:m.start()] + f"DECODE_GEMV: dict[str, str | None] = {{{body}}}\n" + text[m.end():])
    print(f"DECODE_GEMV = {table}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
