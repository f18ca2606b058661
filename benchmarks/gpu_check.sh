#!/bin/bash
# The GPU checks in one run, for a lent GPU machine (repository root; writes its log to $OUT/log
# where $OUT is set, else benchmarks/results/gpu_check.log). The machine's own torch is used: fxzero is installed
# with --no-deps, since the package pins torch 2.13 and such machines cannot download.
# Its first four commands took ~3 min on one H200 (torch 2.11.0+cu130), cold caches. (tests/test_torch_compat.py is for the
# pinned 2.13: on 2.11 its chaining checks fail by design, since 2.11 takes one post-grad pass.)
export PYTHONUNBUFFERED=1
log=${OUT:+$OUT/log}; log=${log:-benchmarks/results/gpu_check.log}
step() { local t=$1; shift; echo; echo "=== [$(date +%T)] $* (limit ${t}s)"; local s=$SECONDS; timeout "$t" "$@"; echo "=== rc=$? in $((SECONDS-s)) s"; }
{
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e .
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
python3 -c "import sys,torch;print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(), 'nccl', torch.cuda.nccl.version())"
step 180 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py -rfE --durations=5
step 90 python3 benchmarks/graph_overhead.py --device cuda --steps 40 --ops
step 60 python3 benchmarks/graph_overhead.py --device cuda --steps 40 --sync-phases
step 70 torchrun --nproc-per-node 1 examples/train_gpt.py --steps 30 --log-every 5 --overlap
step 150 python3 benchmarks/update.py --device cuda --skip-drift --skip-world-2 --rounds 11
step 70 python3 benchmarks/memory.py --world 1 --device cuda --only "DDP gabv + compile" fxzero --steps 4 --png "${OUT:-benchmarks/results}/memory_cuda.png"
} 2>&1 | tee "$log"
