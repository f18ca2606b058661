"""benchmarks/size_check.py: Predicted (fxzero explain --size) vs measured per rank: buffers, optimizer state, and the peak
RSS growth from before the model is built to after two steps (eager, batch 2 x 64). Needs 4 ranks of memory for the 43M GPT."""
import sys
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "examples"))
import torch, fxzero
import torch.distributed as dist
from fxzero.testing import run_ranks
from fxzero.explainer.sizing import size_run

def vm(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024

def work(args):
    from train_gpt import ModelArgs, Transformer
    torch.set_num_threads(1)
    base = vm("VmRSS:")
    torch.manual_seed(0)
    model = Transformer(ModelArgs(**args))
    opt = fxzero.DistributedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3, module=model)
    ids = torch.randint(0, 256, (2, 64))
    for _ in range(2):
        model(ids, ids).backward(); opt.step(); opt.zero_grad()
    buffers = sum(b.nbytes for b in opt.buffers)
    return {"rank": dist.get_rank(), "buffers": buffers, "state": opt.state_bytes, "scratch": opt.runtime_bytes - buffers,
            "peak_growth": vm("VmHWM:") - base}

if __name__ == "__main__":
    from train_gpt import ModelArgs, Transformer
    models = {"main job GPT (train_gpt.py defaults)": dict(), "43M GPT": dict(dim=768, n_layer=6, n_head=12, block_size=64)}
    rows = []
    for name, args in models.items():
        model = Transformer(ModelArgs(**args))
        for world in (2, 4):
            for m in run_ranks(world, work, args, timeout=1200):
                p = size_run(model, world, config=fxzero.Config(bucket_size=None), rank=m["rank"])
                rows.append((name, world, m["rank"], p.param_bytes + p.grad_bytes, m["buffers"], p.state_bytes + p.master_bytes, m["state"], m["scratch"], p.total_bytes, m["peak_growth"]))
    print("| model | world | rank | predicted buffers | measured buffers | predicted state | measured state | measured scratch (gloo) | predicted total | measured peak RSS growth | measured / predicted |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(map(str, r[:3])) + " | " + " | ".join(f"{v:,}" for v in r[3:10]) + f" | {r[9] / r[8]:.2f} |")
