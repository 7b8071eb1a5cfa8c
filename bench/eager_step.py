#!/usr/bin/env python3
"""eager_step.py — the reference for bench_step: actmem's plain GPT step written in PyTorch eager.

Same shapes, [s, b, h] layout, ops and optimizer as src/model/model.cpp and src/train/trainer.cpp (fused qkv,
bmm attention with in-place scale and mask, softmax, native_dropout, bias-dropout-add, GeLU MLP,
tied output layer, cross-entropy, AdamW with gradients kept allocated, global-norm clip), so the
ratio against bench_step measures what actmem adds on top of libtorch's kernels.
Run with the Debian python3-torch, which is built on the same libtorch as the C++ build.
"""
import argparse, json, math, statistics, sys, time

import torch
import torch.nn.functional as F

PRESETS = {
    "default": dict(num_layers=2, hidden_size=128, heads=4, ffn=512, seq=128, micro_batch=8),
    "4x512": dict(num_layers=4, hidden_size=512, heads=8, ffn=2048, seq=512, micro_batch=4),
}


class Layer(torch.nn.Module):
    def __init__(self, h, a, f, p_attn, p_hidden):
        super().__init__()
        self.a, self.d, self.p_attn, self.p_hidden = a, h // a, p_attn, p_hidden
        self.ln1 = torch.nn.LayerNorm(h)
        self.qkv = torch.nn.Linear(h, 3 * h)
        self.proj_w = torch.nn.Parameter(torch.randn(h, h) * 0.02)
        self.proj_b = torch.nn.Parameter(torch.zeros(h))
        self.ln2 = torch.nn.LayerNorm(h)
        self.fc1 = torch.nn.Linear(h, f)
        self.fc2_w = torch.nn.Parameter(torch.randn(h, f) * 0.02)
        self.fc2_b = torch.nn.Parameter(torch.zeros(h))

    def dropout(self, x, p):
        return torch.native_dropout(x, p, True)[0] if p > 0 else x

    def forward(self, x, mask):
        s, b, h = x.shape
        a, d = self.a, self.d
        qkv = self.qkv(self.ln1(x)).view(s, b, a, 3 * d)
        q, k, v = qkv.split(d, -1)
        q3 = q.reshape(s, b * a, d).transpose(0, 1)
        k3t = k.reshape(s, b * a, d).permute(1, 2, 0)
        v3 = v.reshape(s, b * a, d).transpose(0, 1)
        scores = torch.bmm(q3, k3t)
        scores.mul_(1.0 / math.sqrt(d))
        scores4 = scores.view(b, a, s, s)
        scores4.masked_fill_(mask, -10000.0)
        probs = self.dropout(torch.softmax(scores4, -1), self.p_attn)
        ctx = torch.bmm(probs.view(b * a, s, s), v3)
        ctx = ctx.view(b, a, s, d).permute(2, 0, 1, 3).reshape(s, b, h)
        x = x + self.dropout(F.linear(ctx, self.proj_w) + self.proj_b, self.p_hidden)
        y = F.linear(F.gelu(self.fc1(self.ln2(x))), self.fc2_w)
        return x + self.dropout(y + self.fc2_b, self.p_hidden)


class GPT(torch.nn.Module):
    def __init__(self, c, vocab=256, p=0.1):
        super().__init__()
        h = c["hidden_size"]
        self.word = torch.nn.Parameter(torch.randn(vocab, h) * 0.02)
        self.pos = torch.nn.Parameter(torch.randn(c["seq"], h) * 0.02)
        self.layers = torch.nn.ModuleList(
            Layer(h, c["heads"], c["ffn"], p, p) for _ in range(c["num_layers"]))
        self.final = torch.nn.LayerNorm(h)
        self.p = p
        s = c["seq"]
        self.register_buffer("mask", torch.ones(s, s, dtype=torch.bool).triu(1).view(1, 1, s, s))

    def forward(self, tokens, labels):
        s = tokens.shape[1]
        x = (F.embedding(tokens, self.word) + self.pos[:s]).transpose(0, 1).contiguous()
        x = torch.native_dropout(x, self.p, True)[0]
        for layer in self.layers:
            x = layer(x, self.mask)
        logits = torch.matmul(self.final(x), self.word.t())
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.t().reshape(-1))


def bench(name, c, iters, warmup):
    torch.manual_seed(1234)
    model = GPT(c)
    params = list(model.parameters())
    for p in params:
        p.grad = torch.zeros_like(p)
    opt = torch.optim.AdamW(params, lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
    g = torch.Generator().manual_seed(0)
    times = []
    for i in range(warmup + iters):
        tokens = torch.randint(0, 256, (c["micro_batch"], c["seq"] + 1), generator=g)
        x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        for p in params:
            p.grad.zero_()
        t0 = time.perf_counter()
        loss = model(x, y)
        loss.backward()
        with torch.no_grad():
            norm = torch.stack([p.grad.norm() for p in params]).norm().item()
            coeff = 1.0 / (norm + 1e-6)
            if coeff < 1.0:
                for p in params:
                    p.grad.mul_(coeff)
        opt.step()
        dt = time.perf_counter() - t0
        assert math.isfinite(loss.item())
        if i >= warmup:
            times.append(dt)
    step = statistics.median(times)
    tokens = c["seq"] * c["micro_batch"]
    print(f"{name}: {step * 1e3:.1f} ms/step, {tokens / step:.0f} tokens/s (eager)", file=sys.stderr)
    return {"config": name, "step_time_s": step, "step_time_min_s": min(times),
            "tokens_per_s": tokens / step, "threads": torch.get_num_threads(), "iters": iters}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="all", choices=["all", *PRESETS])
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    import os
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    out = [bench(n, c, args.iters, args.warmup) for n, c in PRESETS.items()
           if args.config in ("all", n)]
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
