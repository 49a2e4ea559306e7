"""Re-draw a run's reward curve (``{run_dir}/plots/reward.png``) from its ``metrics.jsonl``.

python -m omni_async.tools.plot_reward RUN_DIR [--out FILE.png] [--title TEXT]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from omni_async.trainer.reward_plot import plot_reward


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m omni_async.tools.plot_reward", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--out", type=Path, default=None, help="PNG to write (default: RUN_DIR/plots/reward.png)")
    parser.add_argument("--title", default=None)
    args = parser.parse_args(argv)
    if not (args.run_dir / "metrics.jsonl").exists():
        print(f"no metrics.jsonl in {args.run_dir} (the run needs trainer.logger to include jsonl)", file=sys.stderr)
        return 2
    out = plot_reward(args.run_dir, args.out, args.title)
    if out is None:
        print(f"{args.run_dir}/metrics.jsonl has no training step", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
