"""Checks for the lab 09 exercises (:mod:`llmlab.solutions.lab09`)."""

from __future__ import annotations

import torch

from llmlab.check._base import _fail, _ok, _close
from llmlab.solutions import lab09 as ex


def online_softmax_update(fn) -> bool:
    name = "online_softmax_update"
    g = torch.Generator().manual_seed(0)
    q_len, d = 3, 4
    scores, v = torch.randn(q_len, 12, generator=g) * 3, torch.randn(12, d, generator=g)
    m, l, acc = torch.full((q_len,), float("-inf")), torch.zeros(q_len), torch.zeros(q_len, d)
    for j in range(0, 12, 4):
        m, l, acc = fn(m, l, acc, scores[:, j : j + 4], v[j : j + 4])
    want = scores.softmax(-1) @ v
    got = acc / l[:, None]
    if not _close(got, want):
        _fail(
            name,
            "after 3 tiles, acc / l should equal softmax(scores) @ V",
            want,
            got,
            "when the running max grows, rescale the old l and acc by exp(m_old - m_new).",
        )
    return _ok(name, "three tiles of online softmax equal the full softmax @ V")


def rms_norm_forward(fn) -> bool:
    name = "rms_norm_forward"
    from llmlab.kernels.reference import rms_norm_reference

    g = torch.Generator().manual_seed(9)
    x = torch.randn(4, 16, generator=g) * 3 + 1  # rows with a non-zero mean
    x[2] = 0.0  # an all-zero row: only eps keeps rstd finite
    w = torch.rand(16, generator=g) + 0.5
    eps = 1e-5
    got = fn(x.clone(), w.clone(), eps)
    if not isinstance(got, (tuple, list)) or len(got) != 2:
        _fail(
            name,
            "the return value",
            "(y [4, 16], rstd [4])",
            type(got).__name__,
            "return a pair: the normalised output and the per-row rstd (fp32).",
        )
    y, rstd = got
    want_y, want_rstd = rms_norm_reference(x, w, eps), ex.rms_norm_forward(x, w, eps)[1]
    for what, a, b in (("rstd, one fp32 value per row,", rstd, want_rstd), ("y", y, want_y)):
        if not _close(a, b):
            row = 0
            if isinstance(a, torch.Tensor) and a.shape == b.shape:
                row = next(
                    i for i in range(b.shape[0]) if not torch.allclose(a[i], b[i], atol=1e-5, rtol=1e-5)
                )
            mean_sub = torch.rsqrt((x - x.mean(-1, keepdim=True)).pow(2).mean(-1) + eps)
            hint = (
                "row 2 is all zeros: rstd = 1/sqrt(0 + eps), so eps goes inside the square root"
                if row == 2
                else "this looks like LayerNorm: RMSNorm does not subtract the mean"
                if isinstance(rstd, torch.Tensor)
                and rstd.shape == mean_sub.shape
                and torch.allclose(rstd, mean_sub)
                else "rstd = 1 / sqrt(mean(x**2 over the last dim) + eps) in fp32 (shape [rows]); "
                "y = x * rstd[:, None] * weight"
            )
            _fail(
                name,
                f"{what} row {row}",
                b[row] if b.dim() > 1 else b,
                a[row] if isinstance(a, torch.Tensor) and a.dim() > 1 and a.shape[0] > row else a,
                hint,
            )
    return _ok(name, "y and rstd equal the reference RMSNorm (the fused kernel's output and saved statistic)")


def causal_k_tiles(fn) -> bool:
    name = "causal_k_tiles"
    for bm, bn, T in ((4, 4, 16), (4, 2, 12), (2, 4, 12), (16, 8, 37), (4, 4, 10)):
        for i in range(-(-T // bm)):
            want = ex.causal_k_tiles(i, bm, bn, T)
            got = fn(i, bm, bn, T)
            got = {k: list(v) for k, v in got.items()} if isinstance(got, dict) else got
            if got == want:
                continue
            q0, q1 = i * bm, min((i + 1) * bm, T) - 1
            what = f"query tile {i} (queries {q0}..{q1}) with block_m {bm}, block_n {bn}, seq_len {T}"
            if not isinstance(got, dict) or got.get("visit") != want["visit"]:
                hint = (
                    "key tile j holds keys j*block_n .. (j+1)*block_n - 1; visit it unless its "
                    f"first key is after the tile's last query ({q1}), i.e. tiles 0 .. "
                    f"{q1} // block_n."
                )
                _fail(
                    name,
                    f"{what}: key tiles visited",
                    want["visit"],
                    got.get("visit") if isinstance(got, dict) else got,
                    hint,
                )
            _fail(
                name,
                f"{what}: key tiles that need the causal mask",
                want["masked"],
                got.get("masked"),
                f"a visited tile needs the mask if its last key (clipped to seq_len) is after the "
                f"tile's first query ({q0}); tiles wholly at or below the diagonal need none.",
            )
    return _ok(name, "visited and masked key tiles match for 5 tilings (the rest are skipped)")


def quantize_per_token(fn) -> bool:
    name = "quantize_per_token"
    from llmlab.kernels.int8_linear import quantize_per_token as engine_quantize

    g = torch.Generator().manual_seed(4)
    x = torch.randn(5, 24, generator=g) * torch.tensor([1e-3, 1.0, 30.0, 0.0, 2.0])[:, None]
    want_q, want_s = engine_quantize(x)
    got = fn(x.clone())
    if not isinstance(got, (tuple, list)) or len(got) != 2:
        _fail(
            name,
            "the return value",
            "(qx int8 [5, 24], sx fp32 [5, 1])",
            type(got).__name__,
            "return a pair: the int8 tensor and the per-token scales.",
        )
    qx, sx = got
    if not isinstance(sx, torch.Tensor) or sx.shape != want_s.shape:
        _fail(
            name,
            "the shape of sx",
            list(want_s.shape),
            list(sx.shape) if isinstance(sx, torch.Tensor) else sx,
            "one scale per token (row), kept as a column [N, 1] so that qx * sx broadcasts: "
            "amax(dim=1, keepdim=True).",
        )
    if not torch.isfinite(sx).all() or not (sx > 0).all():
        _fail(
            name,
            "sx for row 3 (all zeros)",
            want_s[3],
            sx[3],
            "an all-zero row has max 0: clamp the row maximum to at least 1e-12 before dividing by "
            "127, or round(x / sx) gives NaN.",
        )
    for row in (0, 1, 2, 4):  # row 3 is all zeros: any positive scale gives qx = 0
        if not torch.allclose(sx[row].float(), want_s[row], rtol=1e-5, atol=0):
            one = (x.abs().max() / 127).item()
            hint = (
                "this is one scale for the whole tensor (per-tensor): the small rows lose their "
                "precision; take each row's own absolute maximum."
                if abs(sx[row].item() - one) <= 1e-6 * one
                else "sx = max|x[t, :]| / 127 for each token t (the absolute value: a row's largest "
                "magnitude may be negative)."
            )
            _fail(
                name,
                f"sx for row {row} (values of magnitude ~{x[row].abs().max().item():.3g})",
                want_s[row],
                sx[row],
                hint,
            )
    if not isinstance(qx, torch.Tensor) or qx.dtype != torch.int8:
        _fail(
            name,
            "the dtype of qx",
            "torch.int8",
            getattr(qx, "dtype", type(qx).__name__),
            "round, clip to [-127, 127], then .to(torch.int8).",
        )
    if not torch.equal(qx, want_q):
        row = next(i for i in range(5) if not torch.equal(qx[i], want_q[i]))
        _fail(
            name,
            f"qx row {row}",
            want_q[row],
            qx[row],
            "qx = round(x / sx) (round to nearest, not truncation), clipped to [-127, 127].",
        )
    return _ok(name, "per-token scales and int8 values equal the engine's (llmlab.kernels.int8_linear)")
