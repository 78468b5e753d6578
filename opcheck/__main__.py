"""`python -m opcheck [--device cpu|cuda]`: run torch.library.opcheck over the sample matrix
and print one line per sample with its result."""

import argparse
import sys
import time

from .matrix import CHECKS, run, samples


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m opcheck", description=__doc__)
    parser.add_argument("--device", default="cpu", help="device of the sample tensors (default: cpu)")
    parser.add_argument("-k", dest="pattern", default="", help="only samples whose name contains this text")
    args = parser.parse_args()
    matrix = [s for s in samples(args.device) if args.pattern in s.name]
    print(f"opcheck {', '.join(CHECKS)} on {len(matrix)} samples ({args.device})", flush=True)
    failed = 0
    for index, sample in enumerate(matrix, 1):
        start = time.perf_counter()
        try:
            run(sample)
            verdict = "ok"
        except Exception as error:  # report every failure, then exit non-zero
            failed += 1
            verdict = f"FAIL {type(error).__name__}: {str(error).splitlines()[0]}"
        checks = "all" if sample.checks == CHECKS else "+".join(c[5:] for c in sample.checks)
        print(f"[{index:3d}/{len(matrix)}] {sample.name:<66} {checks:<30} {verdict} ({time.perf_counter() - start:.1f} s)",
              flush=True)
    print(f"{len(matrix) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
