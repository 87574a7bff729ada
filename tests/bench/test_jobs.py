"""The quality benchmark's scheduler: real child processes, results in one shared file, failures and deadlines kept."""

import itertools
import json
import time

from regen_service.bench.jobs import Results, run_children

# A child: argv is [-c, CODE, RESULTS, --only, KEY]; "bad" keys fail, others append one result line.
CHILD = """
import json, os, sys, time
path, key = sys.argv[1], sys.argv[-1]
t0 = time.time()
time.sleep(0.5)
if key.startswith("bad"):
    print("boom: something the log keeps"); sys.exit(3)
fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
os.write(fd, (json.dumps({"key": key, "pid": os.getpid(), "span": [t0, time.time()]}) + "\\n").encode())
"""


def test_children_run_in_parallel_and_a_failure_is_a_result_line(tmp_path):
    res = Results(tmp_path / "results.jsonl")
    status = run_children(
        ["a", "b", "bad-c", "d"], ["-c", CHILD, str(res.path)], 4, res, tmp_path / "logs", time.time() + 60
    )
    assert status == {"a": 0, "b": 0, "bad-c": 3, "d": 0}
    recs = {r["key"]: r for r in res.read()}
    assert set(recs) == {"a", "b", "bad-c", "d"}
    assert recs["bad-c"]["error"] == "child exited 3" and "boom" in recs["bad-c"]["log_tail"]
    spans = sorted(recs[k]["span"] for k in "abd")
    assert any(b[0] < a[1] for a, b in itertools.pairwise(spans)), "no two children ran at the same time"


def test_a_deadline_stops_new_launches_and_says_which_did_not_start(tmp_path):
    res = Results(tmp_path / "results.jsonl")
    run_children(["a", "b", "c"], ["-c", CHILD, str(res.path)], 1, res, tmp_path / "logs", time.time() + 0.5)
    lines = res.read()
    done = {r["key"] for r in lines if "key" in r}
    stopped = [r for r in lines if r.get("stage") == "stopped"]
    assert done and len(stopped) == 1
    assert set(stopped[0]["not_started"]) == {"a", "b", "c"} - done
    assert json.loads(res.path.read_text().splitlines()[-1])["reason"] == "deadline"
