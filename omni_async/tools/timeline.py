"""Re-draw a step's timeline from its saved timestamps.

python -m omni_async.tools.timeline RUN_DIR --step K [--out FILE.png]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from omni_async.trainer.timeline import draw_timeline, timeline_path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m omni_async.tools.timeline", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--step", type=int, required=True, help="the logged step (1-based, as in metrics.jsonl)")
    parser.add_argument("--out", type=Path, default=None, help="PNG to write (default: next to the JSON)")
    args = parser.parse_args(argv)
    src = timeline_path(args.run_dir, args.step, "json")
    if not src.exists():
        saved = sorted(p.stem for p in (args.run_dir / "timeline").glob("step_*.json"))
        print(
            f"no timeline for step {args.step} at {src}; saved: {', '.join(saved) or 'none'} "
            "(set trainer.log_timeline_freq to save them)",
            file=sys.stderr,
        )
        return 2
    out = draw_timeline(json.loads(src.read_text()), args.out or src.with_suffix(".png"))
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
