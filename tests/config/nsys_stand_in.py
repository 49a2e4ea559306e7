"""A stand-in for NVIDIA Nsight Systems' launcher, as much of it as Ray's nsight runtime env uses: ``nsys --version``,
and ``nsys profile [options] command...``, which writes the report named by ``-o`` / ``--output`` (``%p``, ``%h``,
``%q{VAR}`` expanded as nsys does, ``.nsys-rep`` appended) and runs the command in its own process (the profiled
process keeps nsys' pid here: exec). Each call is appended to ``nsys_calls.jsonl`` beside this file, so a test can
tell which processes started under it. Installed by the recipe run test as ``nsys`` on the Ray cluster's ``PATH``
(``test_verl_omni_recipe_runs.nsys_on_ray_path``); stdlib only."""

from __future__ import annotations

import json
import os
import re
import socket
import sys
from pathlib import Path


def expand(name: str) -> str:
    name = re.sub(r"%q\{(\w+)\}", lambda m: os.environ.get(m.group(1), ""), name)
    return name.replace("%p", str(os.getpid())).replace("%h", socket.gethostname())


def main(argv: list[str]) -> None:
    if argv[:1] == ["--version"]:
        print("NVIDIA Nsight Systems version 2025.1.1 (stand-in)")
        return
    if argv[:1] != ["profile"]:
        sys.exit(f"nsys stand-in: only --version and profile are supported, got {argv}")
    args, options, i = argv[1:], {}, 0
    while i < len(args) and args[i].startswith("-"):
        name, eq, value = args[i].lstrip("-").partition("=")
        if not eq:  # a one-letter option takes the next argument
            i += 1
            value = args[i]
        options[name] = value
        i += 1
    command = args[i:]
    if not command:
        sys.exit("nsys stand-in: profile needs a command")
    report = expand(options.get("o") or options.get("output") or "report%n")
    report = report if report.endswith(".nsys-rep") else report + ".nsys-rep"
    Path(report).parent.mkdir(parents=True, exist_ok=True)
    record = {"options": options, "command": command, "report": report, "rank": os.environ.get("RANK")}
    Path(report).write_text(json.dumps(record))
    with open(Path(__file__).resolve().parent / "nsys_calls.jsonl", "a") as log:
        log.write(json.dumps(record) + "\n")
    os.execvp(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
