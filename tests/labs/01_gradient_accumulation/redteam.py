"""Lab 01 answers written by a red team that had read only the released notebook (no tests, no solution): the four
of its sixteen graded wrong answers that kept full marks then (tests/labkit.py appends them to answers.py's lists)."""

_ACCUM = '''%%writefile accum_impl.py
"""Exercise 1 of lab 01."""
import contextlib

import torch.distributed as dist


def accumulation_step(model, optimizer, micro_batches, loss_fn):
'''

_LOOP = '''    n_total = sum(len(x) for x, _ in micro_batches)
    K = len(micro_batches)
    total = 0.0
    for k, (x, y) in enumerate(micro_batches):
        with ctx(k, K):
            loss = loss_fn(model(x), y) * (len(x) / n_total)
            loss.backward()
        total += loss.item()
    optimizer.step()
    return total
'''

WRONG_ANSWERS = {
    "accumulation_step": [
        ("clears the old gradients by multiplying them by 0 (an inf or NaN left by an overflowed step survives)",
         _ACCUM + '''    for p in model.parameters():
        if p.grad is not None:
            p.grad.mul_(0)
    ctx = lambda k, K: model.no_sync() if k < K - 1 and hasattr(model, "no_sync") else contextlib.nullcontext()
''' + _LOOP),
        ("chooses no_sync() by dist.is_initialized(), not by the model (a plain module in a distributed job fails)",
         _ACCUM + '''    optimizer.zero_grad(set_to_none=True)
    ctx = lambda k, K: model.no_sync() if k < K - 1 and dist.is_initialized() else contextlib.nullcontext()
''' + _LOOP),
    ],
    "microbatch_loss": [
        ("casts the logits to float32 inside (float64 logits lose 9 digits and get a float32 loss)", '''def microbatch_loss(logits, targets, n_tokens_total, ignore_index=-100):
    V = logits.size(-1)
    return F.cross_entropy(logits.float().reshape(-1, V), targets.reshape(-1), ignore_index=ignore_index,
                           reduction="sum") / n_tokens_total
'''),
        ("flattens with .view (refuses the non-contiguous logits[:, :-1] of a next-token shift)", '''def microbatch_loss(logits, targets, n_tokens_total, ignore_index=-100):
    V = logits.size(-1)
    return F.cross_entropy(logits.view(-1, V), targets.view(-1), ignore_index=ignore_index,
                           reduction="sum") / n_tokens_total
'''),
    ],
}

CORRECT_VARIANTS = {
    "microbatch_loss": [
        ("log_softmax and a gathered sum in the logits' dtype, .flatten", '''def microbatch_loss(logits, targets, n_tokens_total, ignore_index=-100):
    logp = torch.log_softmax(logits.flatten(0, 1), dim=-1)
    flat = targets.flatten()
    keep = flat != ignore_index
    return -logp[keep].gather(1, flat[keep][:, None]).sum() / n_tokens_total
'''),
    ],
}
