#!/usr/bin/env python3
"""pivot-hpc sacct stand-in: `sacct` answered from `scontrol show job` (no slurmdbd).

slurm/local_cluster.sh installs this as /usr/local/bin/sacct on clusters without
accounting, where the real `sacct` fails. submitit polls
`sacct -o JobID,State,NodeList --parsable2 -j ID …` for job states; without an answer it
cannot tell that a job died and `job.result()` waits forever.

What it does: if the cluster has accounting (AccountingStorageType is not
accounting_storage/none) it runs the real sacct. Otherwise it prints, for each job id, one
line in sacct's `--parsable2` format (`|`-separated, header unless -n) with the fields
asked by -o/--format (JobID, JobIDRaw, JobName, State, NodeList, ExitCode, Partition,
Restarts, Elapsed; others are empty). Array tasks print as `ARRAY_TASK`. Jobs that the
controller has already forgotten (MinJobAge) are answered from a small cache of the last
state seen ($PIVOT_SACCT_CACHE, default ~/.cache/pivot_hpc/sacct-cache.json, in a
directory only its owner can open; a cache file someone else owns or can write is
ignored, since job states decide whether submitit reports success). Options it does not
know are ignored; output is always `--parsable2` style.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

DEFAULT_FIELDS = "JobID,JobName,Partition,State,ExitCode"
KEYS = {  # sacct field → scontrol key
    "jobidraw": "JobId",
    "jobname": "JobName",
    "state": "JobState",
    "nodelist": "NodeList",
    "exitcode": "ExitCode",
    "partition": "Partition",
    "restarts": "Restarts",
    "elapsed": "RunTime",
}
FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
         "BOOT_FAIL", "DEADLINE", "PREEMPTED"}  # fmt: skip
TOKEN = re.compile(r"(?:^|\s)([A-Za-z][A-Za-z0-9_:/]*)=")
CACHE = Path(
    os.environ.get("PIVOT_SACCT_CACHE") or Path.home() / ".cache" / "pivot_hpc" / "sacct-cache.json"
)


def real_sacct() -> str | None:
    me = Path(__file__).resolve()
    for d in os.environ.get("PATH", "").split(os.pathsep):
        cand = Path(d) / "sacct"
        if cand.is_file() and os.access(cand, os.X_OK) and cand.resolve() != me:
            return str(cand)
    return None


def accounting_enabled() -> bool:
    try:
        out = subprocess.run(
            ["scontrol", "show", "config"], capture_output=True, text=True, timeout=30
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    m = re.search(r"^AccountingStorageType\s*=\s*(\S+)", out, re.M)
    return bool(m) and m.group(1) != "accounting_storage/none"


def parse_args(argv: list[str]) -> tuple[list[str], list[str], bool]:
    fields, jobs, header = DEFAULT_FIELDS, [], True
    it = iter(argv)
    for a in it:
        if a in ("-o", "--format"):
            fields = next(it, fields)
        elif a.startswith("--format="):
            fields = a.split("=", 1)[1]
        elif a.startswith("-o") and len(a) > 2:
            fields = a[2:]
        elif a in ("-j", "--jobs"):
            jobs.append(next(it, ""))
        elif a.startswith("--jobs="):
            jobs.append(a.split("=", 1)[1])
        elif a.startswith("-j") and len(a) > 2:
            jobs.append(a[2:])
        elif a in ("-n", "--noheader"):
            header = False
    ids = [j for spec in jobs for j in spec.split(",") if j]
    return [f.split("%")[0] for f in fields.split(",") if f], ids, header


def parse_record(line: str) -> dict[str, str]:
    """One `scontrol -o show job` line → {key: value}; values may contain spaces."""
    marks = list(TOKEN.finditer(line))
    rec = {}
    for i, m in enumerate(marks):
        end = marks[i + 1].start() if i + 1 < len(marks) else len(line)
        rec[m.group(1)] = line[m.end() : end].strip()
    return rec


def show(job: str | None) -> list[dict[str, str]]:
    cmd = ["scontrol", "-o", "show", "job"] + ([job] if job else [])
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    if p.returncode != 0:
        return []
    return [parse_record(line) for line in p.stdout.splitlines() if line.startswith("JobId=")]


def row(rec: dict[str, str], fields: list[str]) -> str:
    out = []
    for f in fields:
        key = f.lower()
        if key == "jobid":
            arr, task = rec.get("ArrayJobId"), rec.get("ArrayTaskId")
            if arr and task:
                task = task if re.fullmatch(r"\d+", task) else f"[{task}]"
                out.append(f"{arr}_{task}")
            else:
                out.append(rec.get("JobId", ""))
        elif key == "nodelist":
            v = rec.get("NodeList", "")
            out.append("None assigned" if v in ("", "(null)") else v)
        else:
            out.append(rec.get(KEYS.get(key, "-"), ""))
    return "|".join(out)


def trusted(path: Path) -> bool:
    """Ours, a plain file, and nobody else can write it (nor its directory)."""
    try:
        for st in (path.lstat(), path.parent.stat()):
            if st.st_uid != os.getuid() or st.st_mode & 0o022:
                return False
        return path.is_file() and not path.is_symlink()
    except OSError:
        return False


def load_cache() -> dict[str, list[dict[str, str]]]:
    if not trusted(CACHE):
        return {}
    try:
        data = json.loads(CACHE.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def save_cache(cache: dict[str, list[dict[str, str]]]) -> None:
    try:
        CACHE.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(
            CACHE.with_name(f"{CACHE.name}.{os.getpid()}"),
            os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW,
            0o600,
        )
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(dict(list(cache.items())[-2000:])))
        os.replace(CACHE.with_name(f"{CACHE.name}.{os.getpid()}"), CACHE)
    except OSError:
        pass


def main(argv: list[str]) -> int:
    if accounting_enabled() and (real := real_sacct()):
        os.execv(real, [real, *argv])
    if shutil.which("scontrol") is None:
        print("sacct (pivot-hpc stand-in): scontrol not found on PATH", file=sys.stderr)
        return 1
    fields, ids, header = parse_args(argv)
    cache = load_cache()
    lines = []
    for job in ids or [None]:
        recs = show(job)
        if job is not None and recs:
            cache[job.split("_")[0]] = recs
        elif job is not None:  # forgotten by the controller (MinJobAge): it has ended
            recs = [
                r if r.get("JobState") in FINAL else {**r, "JobState": "COMPLETED"}
                for r in cache.get(job.split("_")[0], [])
            ]
        lines += [row(rec, fields) for rec in recs]
    save_cache(cache)
    if header:
        print("|".join(fields))
    for line in lines:
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
