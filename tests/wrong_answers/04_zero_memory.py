"""Wrong answers for lab 04 (see tests/wrong_answers/__init__.py)."""

_BYTES_HEADER = '''def bytes_per_rank(n_params, world_size, stage, recipe):
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage={stage!r}: ZeRO stages are 0 (DDP), 1, 2 and 3")
    if world_size < 1:
        raise ValueError(f"world_size={world_size!r}: need at least one rank")
'''

_CHECKPOINTED_OK = '''

def checkpointed_bytes_per_layer(batch_size, seq_len, n_embd, n_head):
    return batch_size * seq_len * n_embd * 4
'''

WRONG_ANSWERS = {
    "zero_bytes_per_rank": [
        ("shards the gradients already at stage 1 (they are sharded from stage 2 on)", _BYTES_HEADER + '''
    optimizer = recipe.master_bytes + recipe.optim_bytes
    grads = recipe.grad_bytes / world_size if stage >= 1 else recipe.grad_bytes
    params = recipe.param_bytes / world_size if stage >= 3 else recipe.param_bytes
    optimizer = optimizer / world_size if stage >= 1 else optimizer
    return n_params * (params + grads + optimizer)
'''),
        ("forgets the fp32 master copy of the weights", _BYTES_HEADER + '''
    optimizer = recipe.optim_bytes / world_size if stage >= 1 else recipe.optim_bytes
    grads = recipe.grad_bytes / world_size if stage >= 2 else recipe.grad_bytes
    params = recipe.param_bytes / world_size if stage >= 3 else recipe.param_bytes
    return n_params * (params + grads + optimizer)
'''),
        ("shards the optimizer moments at stage 1 but keeps the master weights replicated until stage 3", _BYTES_HEADER + '''
    optimizer = recipe.optim_bytes / world_size if stage >= 1 else recipe.optim_bytes
    grads = recipe.grad_bytes / world_size if stage >= 2 else recipe.grad_bytes
    weights = recipe.param_bytes + recipe.master_bytes
    weights = weights / world_size if stage >= 3 else weights
    return n_params * (weights + grads + optimizer)
'''),
    ],
    "activation_estimate": [
        ("uses Korthikanti et al.'s fp16 count, 34 bytes per token and channel, for fp32 with fused attention", '''
def activation_bytes_per_layer(batch_size, seq_len, n_embd, n_head):
    return 34 * batch_size * seq_len * n_embd
''' + _CHECKPOINTED_OK),
        ("counts the T x T attention matrix, which the fused attention never stores", '''
def activation_bytes_per_layer(batch_size, seq_len, n_embd, n_head):
    per_token = 16 * n_embd + n_head + 4 + n_head * seq_len
    return batch_size * seq_len * per_token * 4
''' + _CHECKPOINTED_OK),
        ("counts q, k, v and the c_proj input as separate copies of the same storages", '''
def activation_bytes_per_layer(batch_size, seq_len, n_embd, n_head):
    per_token = (n_embd + 2) + n_embd + 3 * n_embd + 3 * n_embd + n_embd + n_head + n_embd + (n_embd + 2) + n_embd + 8 * n_embd
    return batch_size * seq_len * per_token * 4
''' + _CHECKPOINTED_OK),
        ("with checkpointing keeps every block's activations anyway (the estimate does not change)", '''
def activation_bytes_per_layer(batch_size, seq_len, n_embd, n_head):
    return batch_size * seq_len * (16 * n_embd + n_head + 4) * 4


def checkpointed_bytes_per_layer(batch_size, seq_len, n_embd, n_head):
    return activation_bytes_per_layer(batch_size, seq_len, n_embd, n_head)
'''),
    ],
}
