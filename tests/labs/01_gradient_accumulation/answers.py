"""Wrong answers for lab 01 (tests/labkit.py: the lab's answer files)."""

_ACCUM_HEADER = '''%%writefile accum_impl.py
import contextlib


def accumulation_step(model, optimizer, micro_batches, loss_fn):
'''

WRONG_ANSWERS = {
    "accumulation_step": [
        ("forgets to weight the micro-batch losses (plain sum of the means)", _ACCUM_HEADER + '''
    optimizer.zero_grad()
    total = 0.0
    for i, (x, y) in enumerate(micro_batches):
        ctx = model.no_sync() if hasattr(model, "no_sync") and i < len(micro_batches) - 1 else contextlib.nullcontext()
        with ctx:
            loss = loss_fn(model(x), y)
            loss.backward()
        total += loss.item() / len(micro_batches)
    optimizer.step()
    return total
'''),
        ("divides by K: right only when every micro-batch has the same size", _ACCUM_HEADER + '''
    K = len(micro_batches)
    optimizer.zero_grad()
    total = 0.0
    for i, (x, y) in enumerate(micro_batches):
        ctx = model.no_sync() if hasattr(model, "no_sync") and i < K - 1 else contextlib.nullcontext()
        with ctx:
            loss = loss_fn(model(x), y) / K
            loss.backward()
        total += loss.item()
    optimizer.step()
    return total
'''),
        ("correct math but no no_sync(): K all-reduces per step under DDP", _ACCUM_HEADER + '''
    n = sum(len(x) for x, _ in micro_batches)
    optimizer.zero_grad()
    total = 0.0
    for x, y in micro_batches:
        loss = loss_fn(model(x), y) * len(x) / n
        loss.backward()
        total += loss.item()
    optimizer.step()
    return total
'''),
        ("no_sync() on every micro-batch, the last one too: gradients never all-reduced", _ACCUM_HEADER + '''
    n = sum(len(x) for x, _ in micro_batches)
    optimizer.zero_grad()
    total = 0.0
    for x, y in micro_batches:
        ctx = model.no_sync() if hasattr(model, "no_sync") else contextlib.nullcontext()
        with ctx:
            loss = loss_fn(model(x), y) * len(x) / n
            loss.backward()
        total += loss.item()
    optimizer.step()
    return total
'''),
        ("no_sync() on the last micro-batch and sync on the first (the wrong end)", _ACCUM_HEADER + '''
    n = sum(len(x) for x, _ in micro_batches)
    optimizer.zero_grad()
    total = 0.0
    for i, (x, y) in enumerate(micro_batches):
        ctx = model.no_sync() if hasattr(model, "no_sync") and i > 0 else contextlib.nullcontext()
        with ctx:
            loss = loss_fn(model(x), y) * len(x) / n
            loss.backward()
        total += loss.item()
    optimizer.step()
    return total
'''),
        ("zeroes .grad after the step instead of before: stale gradients from before the call leak in", _ACCUM_HEADER + '''
    n = sum(len(x) for x, _ in micro_batches)
    total = 0.0
    for i, (x, y) in enumerate(micro_batches):
        ctx = model.no_sync() if hasattr(model, "no_sync") and i < len(micro_batches) - 1 else contextlib.nullcontext()
        with ctx:
            loss = loss_fn(model(x), y) * len(x) / n
            loss.backward()
        total += loss.item()
    optimizer.step()
    optimizer.zero_grad()
    return total
'''),
        ("consumes the caller's list: pops each micro-batch off it (the caller's batch is gone after the call)",
         _ACCUM_HEADER + '''
    n = sum(len(x) for x, _ in micro_batches)
    optimizer.zero_grad()
    total = 0.0
    while micro_batches:
        x, y = micro_batches.pop(0)
        ctx = model.no_sync() if hasattr(model, "no_sync") and micro_batches else contextlib.nullcontext()
        with ctx:
            loss = loss_fn(model(x), y) * len(x) / n
            loss.backward()
        total += loss.item()
    optimizer.step()
    return total
'''),
        ("scales the gradients with a hook registered on every call: the hooks pile up on the same model", _ACCUM_HEADER + '''
    n = sum(len(x) for x, _ in micro_batches)
    optimizer.zero_grad()
    weight = {"now": 1.0}
    for p in model.parameters():
        p.register_hook(lambda g: g * weight["now"])
    total = 0.0
    for i, (x, y) in enumerate(micro_batches):
        weight["now"] = len(x) / n
        ctx = model.no_sync() if hasattr(model, "no_sync") and i < len(micro_batches) - 1 else contextlib.nullcontext()
        with ctx:
            loss = loss_fn(model(x), y)
            loss.backward()
        total += loss.item() * len(x) / n
    optimizer.step()
    return total
'''),
        ("steps the optimizer after every micro-batch", _ACCUM_HEADER + '''
    n = sum(len(x) for x, _ in micro_batches)
    total = 0.0
    for x, y in micro_batches:
        optimizer.zero_grad()
        loss = loss_fn(model(x), y) * len(x) / n
        loss.backward()
        optimizer.step()
        total += loss.item()
    return total
'''),
    ],
    "microbatch_loss": [
        ("mean over the micro-batch's tokens divided by K (sample-weighted)", '''
def microbatch_loss(logits, targets, n_tokens_total, ignore_index=-100):
    K = 2
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=ignore_index) / K
'''),
        ("mean over the micro-batch scaled by its share of the tokens (NaN for an all-padding micro-batch)", '''
def microbatch_loss(logits, targets, n_tokens_total, ignore_index=-100):
    n_here = (targets != ignore_index).sum()
    mean = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=ignore_index)
    return mean * n_here / n_tokens_total
'''),
        ("hard-codes ignore_index=-100 instead of passing the argument on", '''
def microbatch_loss(logits, targets, n_tokens_total, ignore_index=-100):
    loss_sum = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-100, reduction="sum")
    return loss_sum / n_tokens_total
'''),
        ("counts the real tokens itself, assuming padding is -100", '''
def microbatch_loss(logits, targets, n_tokens_total, ignore_index=-100):
    mask = targets.reshape(-1) != -100
    losses = F.cross_entropy(logits.reshape(-1, logits.size(-1))[mask], targets.reshape(-1)[mask], reduction="sum")
    return losses / n_tokens_total
'''),
        ("a log of a softmax instead of a log-softmax: -inf for logits far from zero", '''
def microbatch_loss(logits, targets, n_tokens_total, ignore_index=-100):
    logp = torch.log(torch.softmax(logits, dim=-1)).reshape(-1, logits.size(-1))
    return F.nll_loss(logp, targets.reshape(-1), ignore_index=ignore_index, reduction="sum") / n_tokens_total
'''),
        ("subtracts the max from the caller's logits in place (for stability): the caller's tensor is changed", '''
def microbatch_loss(logits, targets, n_tokens_total, ignore_index=-100):
    logits -= logits.max(dim=-1, keepdim=True).values.detach()
    loss_sum = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=ignore_index,
                               reduction="sum")
    return loss_sum / n_tokens_total
'''),
    ],
    "bn_answer": [
        ("believes BatchNorm sees the effective batch", 'bn_answer = "a"'),
    ],
    "lr_scaling": [
        ("forgets the world size in the effective batch", '''
def effective_batch_size(micro_batch_size, accum_steps, world_size):
    return micro_batch_size * accum_steps


def scaled_learning_rate(base_lr, base_batch_size, batch_size):
    return base_lr * batch_size / base_batch_size
'''),
        ("scales the learning rate the wrong way round", '''
def effective_batch_size(micro_batch_size, accum_steps, world_size):
    return micro_batch_size * accum_steps * world_size


def scaled_learning_rate(base_lr, base_batch_size, batch_size):
    return base_lr * base_batch_size / batch_size
'''),
    ],
}
