"""Start-up of every `bertfast <command> --help`, as whole processes, against the command's own module
parsing `--help` (what each help cost before the torch-free parsers of bertfast/cli.py: LIGHT_HELP).

    python benchmarks/cli-startup/startup.py --runs 5

Runs each command in turn, a warm-up first, and prints a markdown table of wall seconds (median
[min, max]). A benchmark, not a test: the figure depends on the machine and its load.
"""
import argparse
import statistics
import subprocess
import sys
import time

from bertfast.cli import COMMANDS


def wall(argv, runs: int):
    subprocess.run(argv, capture_output=True, check=True)  # warm-up: file caches, .pyc
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(argv, capture_output=True, check=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times), min(times), max(times)


def cell(figures) -> str:
    median, low, high = figures
    return f"{median:.2f} [{low:.2f}, {high:.2f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="timed runs of each command after a warm-up")
    parser.add_argument("--commands", default=",".join(["(none)", *COMMANDS]),
                        help="comma-separated commands; (none) is plain `bertfast --help`")
    args = parser.parse_args()
    print("| command | `bertfast <command> --help` s | its module's main(['--help']) s |")
    print("| --- | --- | --- |")
    for name in args.commands.split(","):
        if name == "(none)":
            help_argv, module = [sys.executable, "-m", "bertfast.cli", "--help"], "bertfast.cli"
        else:
            help_argv, module = [sys.executable, "-m", "bertfast.cli", name, "--help"], COMMANDS[name][0]
        own = wall([sys.executable, "-c", f"import {module} as m; m.main(['--help'])"], args.runs)
        print(f"| {name} | {cell(wall(help_argv, args.runs))} | {cell(own)} |", flush=True)


if __name__ == "__main__":
    main()
