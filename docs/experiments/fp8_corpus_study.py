"""Does the FP8 expert-GEMM loss gap come from the synthetic corpus being a memorised lookup table?

Question. On one H200 the Qwen3-30B-shaped config (configs/h200x2-qwen3-30b.yaml, data.kind
synthetic, alphabet 4096) trained 200 steps ended +4.7% over bf16 with the routed experts' gate/up
GEMM in FP8 e4m3, and at bf16's loss with FP8 only in the down GEMM. The synthetic corpus
(disagmoe/data.py `synthetic_corpus`) is a fixed random order-2 Markov chain: learning it is
memorising a random table. Hypothesis: the FP8 forward's noise costs loss mostly because of that;
on data with language-like structure the same recipe costs far less.

Recipe (fake-quantised on the CPU, fp32 everywhere else). In the forward of an expert GEMM
y = x @ w: x's rows quantised in 1 x 128 groups along the contraction dim, w (per expert, [K, N])
in 128 x 128 blocks, scale = amax / 448, value -> (value / scale) to float8_e4m3fn and back, times
scale; the product accumulated in fp32. The backward is straight-through: dx = dy @ w^T and
dw = x^T @ dy with the UNquantised x and w (the repo's FP8 path keeps the bf16 backward).
Variants: `base` (fp32), `fp8_13` (gate/up GEMM, x @ w13, in FP8), `fp8_2` (down GEMM, h @ w2, in
FP8), and `base_s1` (the baseline with another init seed: the run-to-run noise). Every run of a
corpus sees the same batches in the same order; only `base_s1` changes the initialisation.

Model: a compact MoE transformer in plain torch (RMSNorm, causal attention with RoPE and qk-norm,
softmax top-k router with renormalised top-k weights and a switch aux loss (coef 0.02), SwiGLU
routed experts, untied head, unit-std embedding, every other weight N(0, 0.02^2), as the repo's
init). AdamW (0.9, 0.95), no weight decay, grad clip 1.0, linear warm-up then cosine to 0.1 x lr.

Corpora:
  synth<K>: `disagmoe.data.synthetic_corpus(alphabet_size=K)`, vocab K (2^20 tokens, last 5% held out).
  text:     byte-level (vocab 256) text of this repository's tracked *.md and *.py files at HEAD,
            concatenated in `git ls-files` order (prose and code), last 5% held out.

After the baseline of each corpus, the gate/up and down GEMMs' relative output error under the
fake-quant, ||fq(x) @ fq(w) - x @ w||_F / ||x @ w||_F, is measured on a held-out batch of the
trained model's real routed activations (per layer), and on random Gaussian operands for reference.

Results and what they leave: fp8_corpus_study.md beside this file.

Command (about 50 minutes on one busy CPU thread):
  .venv/bin/python docs/experiments/fp8_corpus_study.py
  .venv/bin/python docs/experiments/fp8_corpus_study.py --steps 40 --corpora text   # a quick check
"""

from __future__ import annotations

import argparse
import math
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

torch.set_num_threads(1)

E4M3_MAX = 448.0
BLOCK = 128
AMAX_FLOOR = 1e-30
REPO = Path(__file__).resolve().parents[2]


# --- the fake quantisers (the recipe's scaling, e4m3 round trip) -----------------------------------

def _e4m3_round_trip(v: torch.Tensor) -> torch.Tensor:
    return v.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).to(torch.float32)


def fq_rows(x_MK: torch.Tensor) -> torch.Tensor:
    """x's rows in 1 x 128 groups along K (K a multiple of 128), each group's scale amax / 448."""
    M, K = x_MK.shape
    g = x_MK.reshape(M, K // BLOCK, BLOCK)
    scale = g.abs().amax(dim=-1, keepdim=True).clamp_min(AMAX_FLOOR) / E4M3_MAX
    return (_e4m3_round_trip(g / scale) * scale).reshape(M, K)


def fq_blocks(w_EKN: torch.Tensor) -> torch.Tensor:
    """Each expert's [K, N] weight in 128 x 128 blocks, each block's scale amax / 448."""
    E, K, N = w_EKN.shape
    b = w_EKN.reshape(E, K // BLOCK, BLOCK, N // BLOCK, BLOCK)
    scale = b.abs().amax(dim=(2, 4), keepdim=True).clamp_min(AMAX_FLOOR) / E4M3_MAX
    return (_e4m3_round_trip(b / scale) * scale).reshape(E, K, N)


class GroupedGemm(torch.autograd.Function):
    """y[rows of e] = x[rows of e] @ w[e] for rows grouped by expert (`counts` rows each); with
    `fp8` the forward multiplies the fake-quantised operands, the backward the original ones."""

    @staticmethod
    def forward(ctx, x_MK, w_EKN, counts, fp8):  # noqa: ANN001, ANN205
        ctx.save_for_backward(x_MK, w_EKN)
        ctx.counts = counts
        xq, wq = (fq_rows(x_MK), fq_blocks(w_EKN)) if fp8 else (x_MK, w_EKN)
        y = x_MK.new_empty(x_MK.shape[0], w_EKN.shape[2])
        start = 0
        for e, n in enumerate(counts):
            if n:
                torch.mm(xq[start:start + n], wq[e], out=y[start:start + n])
            start += n
        return y

    @staticmethod
    def backward(ctx, dy_MN):  # noqa: ANN001, ANN205
        x_MK, w_EKN = ctx.saved_tensors
        dx = torch.zeros_like(x_MK)
        dw = torch.zeros_like(w_EKN)
        start = 0
        for e, n in enumerate(ctx.counts):
            if n:
                d = dy_MN[start:start + n]
                torch.mm(d, w_EKN[e].t(), out=dx[start:start + n])
                torch.mm(x_MK[start:start + n].t(), d, out=dw[e])
            start += n
        return dx, dw, None, None


def rel_err(x_MK: torch.Tensor, w_EKN: torch.Tensor, counts: list[int]) -> float:
    exact = GroupedGemm.apply(x_MK, w_EKN, counts, False)
    quant = GroupedGemm.apply(x_MK, w_EKN, counts, True)
    return float((quant - exact).norm() / exact.norm())


# --- the model -------------------------------------------------------------------------------------

@dataclass
class Cfg:
    vocab: int
    hidden: int = 256
    layers: int = 2
    heads: int = 4
    experts: int = 16
    top_k: int = 4
    ffn: int = 256
    seq: int = 128
    aux_coef: float = 0.02
    fp8_13: bool = False
    fp8_2: bool = False


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_tables(seq: int, head_dim: int, theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    ang = torch.outer(torch.arange(seq).float(), inv)
    return ang.cos(), ang.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., ::2], x[..., 1::2]  # x [B, S, heads, hd]; cos, sin [S, hd / 2]
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, c: Cfg) -> None:
        super().__init__()
        self.heads, self.hd = c.heads, c.hidden // c.heads
        self.qkv = nn.Linear(c.hidden, 3 * c.hidden, bias=False)
        self.out = nn.Linear(c.hidden, c.hidden, bias=False)
        self.q_norm, self.k_norm = RMSNorm(self.hd), RMSNorm(self.hd)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, S, H = x.shape
        q, k, v = self.qkv(x).view(B, S, 3, self.heads, self.hd).unbind(2)
        q, k = apply_rope(self.q_norm(q), cos, sin), apply_rope(self.k_norm(k), cos, sin)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.out(o.transpose(1, 2).reshape(B, S, H))


class MoE(nn.Module):
    def __init__(self, c: Cfg) -> None:
        super().__init__()
        self.c = c
        self.router = nn.Parameter(torch.empty(c.experts, c.hidden))
        self.w13 = nn.Parameter(torch.empty(c.experts, c.hidden, 2 * c.ffn))  # [gate | up] columns
        self.w2 = nn.Parameter(torch.empty(c.experts, c.ffn, c.hidden))
        self.capture: dict | None = None  # set to {} to record one forward's routed operands

    def forward(self, xn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.c
        shape = xn.shape
        x = xn.reshape(-1, c.hidden)
        N = x.shape[0]
        probs = F.softmax(x @ self.router.t(), dim=-1)
        top_w, top_i = probs.topk(c.top_k, dim=-1)
        top_w = top_w / top_w.sum(-1, keepdim=True)
        flat_e = top_i.reshape(-1)
        order = torch.argsort(flat_e, stable=True)
        token = order // c.top_k
        load = torch.bincount(flat_e, minlength=c.experts)
        counts = load.tolist()
        xs = x[token]
        h = GroupedGemm.apply(xs, self.w13, counts, c.fp8_13)
        a = F.silu(h[:, :c.ffn]) * h[:, c.ffn:]
        y = GroupedGemm.apply(a, self.w2, counts, c.fp8_2)
        y = y * top_w.reshape(-1)[order].unsqueeze(1)
        out = torch.zeros_like(x).index_add_(0, token, y)
        aux = c.aux_coef * c.experts * ((load.float() / (N * c.top_k)) * probs.mean(0)).sum()
        if self.capture is not None:
            self.capture.update(xs=xs.detach(), a=a.detach(), counts=counts)
        return out.view(shape), aux


class Block(nn.Module):
    def __init__(self, c: Cfg) -> None:
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(c.hidden), Attention(c)
        self.ffn_norm, self.moe = RMSNorm(c.hidden), MoE(c)

    def forward(self, x, cos, sin):  # noqa: ANN001, ANN201
        x = x + self.attn(self.attn_norm(x), cos, sin)
        y, aux = self.moe(self.ffn_norm(x))
        return x + y, aux


class Model(nn.Module):
    def __init__(self, c: Cfg, seed: int) -> None:
        super().__init__()
        self.c = c
        self.embed = nn.Embedding(c.vocab, c.hidden)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.norm = RMSNorm(c.hidden)
        self.head = nn.Linear(c.hidden, c.vocab, bias=False)
        cos, sin = rope_tables(c.seq, c.hidden // c.heads)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):
                    continue
                p.normal_(0.0, 1.0 if name == "embed.weight" else 0.02, generator=g)

    def forward(self, idx: torch.Tensor, tgt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.embed(idx)
        aux = x.new_zeros(())
        for b in self.blocks:
            x, a = b(x, self.cos, self.sin)
            aux = aux + a
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.view(-1, self.c.vocab), tgt.reshape(-1)), aux


# --- data ------------------------------------------------------------------------------------------

def load_corpus(name: str) -> tuple[np.ndarray, int, str]:
    if name.startswith("synth"):
        from disagmoe.data import synthetic_corpus

        k = int(name[len("synth"):])
        return synthetic_corpus(alphabet_size=k).astype(np.int64), k, f"synthetic_corpus(alphabet_size={k})"
    if name == "text":
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
        files = subprocess.run(["git", "ls-files", "*.md", "*.py"], cwd=REPO, capture_output=True, text=True,
                               check=True).stdout.split()
        blobs = subprocess.run(["git", "cat-file", "--batch"], cwd=REPO, check=True, capture_output=True,
                               input="".join(f"HEAD:{f}\n" for f in files).encode()).stdout
        chunks, pos = [], 0
        while pos < len(blobs):  # "<sha> blob <size>\n<bytes>\n"
            nl = blobs.index(b"\n", pos)
            size = int(blobs[pos:nl].split()[2])
            chunks.append(blobs[nl + 1:nl + 1 + size])
            pos = nl + 1 + size + 1
        data = b"".join(chunks)
        return np.frombuffer(data, dtype=np.uint8).astype(np.int64), 256, (
            f"bytes of the {len(files)} tracked *.md/*.py files at {head} ({len(data)} bytes)")
    raise ValueError(name)


def batch(tokens: np.ndarray, step: int, bsz: int, seq: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(tokens) - seq - 1, size=bsz)
    w = torch.from_numpy(np.stack([tokens[s:s + seq + 1] for s in starts]))
    return w[:, :-1], w[:, 1:]


# --- training --------------------------------------------------------------------------------------

def train(c: Cfg, train_tok: np.ndarray, val_tok: np.ndarray, args: argparse.Namespace, seed: int,
          label: str) -> dict:
    torch.manual_seed(seed)
    model = Model(c, seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0, eps=1e-8)
    losses, t0 = [], time.time()
    for step in range(args.steps):
        if step < args.warmup:
            lr = args.lr * (step + 1) / args.warmup
        else:
            prog = (step - args.warmup) / max(1, args.steps - 1 - args.warmup)
            lr = args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * prog)))
        for g in opt.param_groups:
            g["lr"] = lr
        x, y = batch(train_tok, step, args.batch, c.seq, args.data_seed)
        loss, aux = model(x, y)
        opt.zero_grad(set_to_none=True)
        (loss + aux).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if (step + 1) % args.log_every == 0:
            print(f"  [{label}] step {step + 1}/{args.steps} loss {np.mean(losses[-10:]):.4f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
    model.eval()
    with torch.no_grad():
        val = float(np.mean([model(*batch(val_tok, i, args.batch, c.seq, 999))[0].item()
                             for i in range(args.val_batches)]))
    return dict(model=model, losses=np.array(losses), val=val, secs=time.time() - t0)


def measure_errors(model: Model, val_tok: np.ndarray, args: argparse.Namespace) -> list[tuple[float, float]]:
    """Per layer: (gate/up, down) relative output error of the fake-quant on one held-out batch."""
    for b in model.blocks:
        b.moe.capture = {}
    with torch.no_grad():
        model(*batch(val_tok, 0, args.batch, model.c.seq, 999))
    out = []
    for b in model.blocks:
        cap = b.moe.capture
        b.moe.capture = None
        out.append((rel_err(cap["xs"], b.moe.w13.detach(), cap["counts"]),
                    rel_err(cap["a"], b.moe.w2.detach(), cap["counts"])))
    return out


def report(rows: list[tuple], errs: dict) -> None:
    print("\nloss = mean train LM loss over the 10 steps ending at each checkpoint; val = held-out LM loss at the end")
    print("gap = relative to `base` (same seed, same batches); d50 = mean over the last 50 steps of (loss - base loss)")
    hdr = f"{'corpus':9} {'variant':8} {'25%':>7} {'50%':>7} {'75%':>7} {'100%':>7} {'val':>7} " \
          f"{'gap':>7} {'gap_val':>7} {'d50':>8} {'secs':>6}"
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(f"{r[0]:9} {r[1]:8} {r[2]:7.4f} {r[3]:7.4f} {r[4]:7.4f} {r[5]:7.4f} {r[6]:7.4f} "
              f"{r[7]:+6.2f}% {r[8]:+6.2f}% {r[9]:+8.4f} {r[10]:6.0f}")
    print("\nrelative output error ||fq(x)@fq(w) - x@w|| / ||x@w|| on a held-out batch, per layer (gate/up, down):")
    for corpus, (e_base, e_fp8) in errs.items():
        for name, e in (("base-trained", e_base), ("fp8_13-trained", e_fp8)):
            if e:
                print(f"  {corpus:9} {name:15} " + "  ".join(f"L{i}: {a:.4f} / {d:.4f}" for i, (a, d) in enumerate(e)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpora", default="text,synth512,synth4096", help="comma list: synth<K> (e.g. synth4096), text")
    p.add_argument("--variants", default="base,fp8_13,fp8_2,base_s1")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--ffn", type=int, default=256)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-seed", type=int, default=1234)
    p.add_argument("--val-batches", type=int, default=8)
    p.add_argument("--log-every", type=int, default=50)
    args = p.parse_args()
    assert args.hidden % BLOCK == 0 and (2 * args.ffn) % BLOCK == 0 and args.ffn % BLOCK == 0

    g = torch.Generator().manual_seed(0)  # the reference: random operands of the init's scale
    xr, wr = torch.randn(4096, args.hidden, generator=g), 0.02 * torch.randn(1, args.hidden, 2 * args.ffn, generator=g)
    print(f"random-operand gate/up rel. error (x ~ N(0,1), w ~ N(0,0.02^2)): {rel_err(xr, wr, [4096]):.4f}")

    rows, errs = [], {}
    for corpus in args.corpora.split(","):
        tokens, vocab, desc = load_corpus(corpus)
        cut = int(len(tokens) * 0.95)
        train_tok, val_tok = tokens[:cut], tokens[cut:]
        print(f"corpus {corpus}: {desc}; {len(train_tok)} train / {len(val_tok)} val tokens, vocab {vocab}; "
              f"{args.steps} steps x {args.batch * args.seq} tokens", flush=True)
        runs = {}
        for v in args.variants.split(","):
            c = Cfg(vocab=vocab, hidden=args.hidden, layers=args.layers, experts=args.experts, top_k=args.top_k,
                    ffn=args.ffn, seq=args.seq, fp8_13=v == "fp8_13", fp8_2=v == "fp8_2")
            seed = args.seed + (1 if v == "base_s1" else 0)
            r = train(c, train_tok, val_tok, args, seed, f"{corpus}/{v}")
            if v == "base":
                errs[corpus] = (measure_errors(r["model"], val_tok, args), None)
            if v == "fp8_13":
                errs[corpus] = (errs.get(corpus, (None,))[0], measure_errors(r["model"], val_tok, args))
            r.pop("model")
            runs[v] = r
        base = runs.get("base")
        for v, r in runs.items():
            L, n = r["losses"], len(r["losses"])
            cps = [float(L[max(0, int(n * f) - 10):int(n * f)].mean()) for f in (0.25, 0.5, 0.75, 1.0)]
            gap = gap_val = paired = float("nan")
            if base is not None:
                b_end = base["losses"][-10:].mean()
                gap = 100 * (cps[-1] / b_end - 1)
                gap_val = 100 * (r["val"] / base["val"] - 1)
                paired = float((L[-50:] - base["losses"][-50:]).mean())
            rows.append((corpus, v, *cps, r["val"], gap, gap_val, paired, r["secs"]))
        report(rows, errs)  # after each corpus, so a cut-short study still leaves its tables


if __name__ == "__main__":
    main()
