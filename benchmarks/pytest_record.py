"""A GPU test run's record: the verdict of every test from pytest's `-rA` summary, with the command and the
environment (commit, date, device, versions) of the machine that ran it.

  python benchmarks/pytest_record.py TESTS.txt OUT.json --command "python3 -m pytest ..." \
      [--environment-from A_RECORD_OF_THE_SAME_RUN.json]
Without --environment-from the environment is read here (run it on the machine that ran the tests).
"""
import argparse
import json
import re
import sys

VERDICT = re.compile(r"^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\s+(\S.*?)(?: - .*)?$")


def verdicts(text: str) -> list[list[str]]:
    """[verdict, test id or skip reason] of each summary line."""
    return [[m.group(1), m.group(2)] for m in map(VERDICT.match, text.splitlines()) if m]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("tests_txt")
    ap.add_argument("out")
    ap.add_argument("--command", required=True)
    ap.add_argument("--environment-from", default="")
    a = ap.parse_args()
    with open(a.tests_txt) as f:
        rows = verdicts(f.read())
    if not rows:
        print(f"{a.tests_txt}: no pytest -rA summary lines (PASSED/FAILED/...): run pytest with -rA", file=sys.stderr)
        return 2
    if a.environment_from:
        with open(a.environment_from) as f:
            env = json.load(f)["environment"]
    else:
        from rollplex_megatron.runtime import environment_record
        env = environment_record()
    failed = [t for v, t in rows if v in ("FAILED", "ERROR")]
    rec = {"command": a.command, "verdict": "FAILED" if failed else "PASSED", "failed": failed,
           "verdicts": rows, "environment": env}
    with open(a.out, "w") as f:
        json.dump(rec, f, indent=1)
    print(json.dumps({k: rec[k] for k in ("verdict", "failed")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
