"""Wrong answers for lab 04 (tests/labkit.py: the lab's answer files)."""

_BYTES_HEADER = '''def bytes_per_rank(n_params, world_size, stage, recipe):
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage={stage!r}: ZeRO stages are 0 (DDP), 1, 2 and 3")
    if world_size < 1:
        raise ValueError(f"world_size={world_size!r}: need at least one rank")
'''

_CHECKPOINTED_OK = '''

def checkpointed_bytes_per_layer(batch_size, seq_len, n_embd, n_head, ffn_hidden):
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
        ("rounds each rank's share down to whole parameters (integer division)", _BYTES_HEADER + '''
    optimizer = (recipe.master_bytes + recipe.optim_bytes) * (n_params // world_size if stage >= 1 else n_params)
    grads = recipe.grad_bytes * (n_params // world_size if stage >= 2 else n_params)
    params = recipe.param_bytes * (n_params // world_size if stage >= 3 else n_params)
    return params + grads + optimizer
'''),
        ("rejects world_size 0 but not a negative one", '''def bytes_per_rank(n_params, world_size, stage, recipe):
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage={stage!r}: ZeRO stages are 0 (DDP), 1, 2 and 3")
    if world_size == 0:
        raise ValueError("world_size must not be 0")
    optimizer = recipe.master_bytes + recipe.optim_bytes
    optimizer = optimizer / world_size if stage >= 1 else optimizer
    grads = recipe.grad_bytes / world_size if stage >= 2 else recipe.grad_bytes
    params = recipe.param_bytes / world_size if stage >= 3 else recipe.param_bytes
    return n_params * (params + grads + optimizer)
'''),
    ],
    "activation_estimate": [
        ("drops the small terms: LayerNorm's mean and 1/sigma per token", '''
def activation_bytes_per_layer(batch_size, seq_len, n_embd, n_head, ffn_hidden):
    return batch_size * seq_len * (8 * n_embd + n_head * seq_len + 4 * ffn_hidden) * 4
''' + _CHECKPOINTED_OK),
        ("keeps only the big term, 16 C per token (the table's leading term)", '''
def activation_bytes_per_layer(batch_size, seq_len, n_embd, n_head, ffn_hidden):
    return batch_size * seq_len * 16 * n_embd * 4
''' + _CHECKPOINTED_OK),
        ("reuses the table's fused-attention, GELU-MLP count (16 C + H + 4) for this block", '''
def activation_bytes_per_layer(batch_size, seq_len, n_embd, n_head, ffn_hidden):
    return batch_size * seq_len * (16 * n_embd + n_head + 4) * 4
''' + _CHECKPOINTED_OK),
        ("counts one log-sum-exp per head (fused attention) instead of the T x T probabilities", '''
def activation_bytes_per_layer(batch_size, seq_len, n_embd, n_head, ffn_hidden):
    return batch_size * seq_len * (8 * n_embd + 4 + n_head + 4 * ffn_hidden) * 4
''' + _CHECKPOINTED_OK),
        ("counts the scores as well as the probabilities (softmax saves only its output)", '''
def activation_bytes_per_layer(batch_size, seq_len, n_embd, n_head, ffn_hidden):
    return batch_size * seq_len * (8 * n_embd + 4 + 2 * n_head * seq_len + 4 * ffn_hidden) * 4
''' + _CHECKPOINTED_OK),
        ("counts half the T x T matrix because the causal mask zeroes the upper triangle", '''
def activation_bytes_per_layer(batch_size, seq_len, n_embd, n_head, ffn_hidden):
    per_token = 8 * n_embd + 4 + n_head * (seq_len + 1) / 2 + 4 * ffn_hidden
    return batch_size * seq_len * per_token * 4
''' + _CHECKPOINTED_OK),
        ("counts the T x T probabilities once per sequence, not once per head", '''
def activation_bytes_per_layer(batch_size, seq_len, n_embd, n_head, ffn_hidden):
    return batch_size * seq_len * (8 * n_embd + 4 + seq_len + 4 * ffn_hidden) * 4
''' + _CHECKPOINTED_OK),
        ("SwiGLU saves 3F: treats SiLU's input and output as one tensor", '''
def activation_bytes_per_layer(batch_size, seq_len, n_embd, n_head, ffn_hidden):
    return batch_size * seq_len * (8 * n_embd + 4 + n_head * seq_len + 3 * ffn_hidden) * 4
''' + _CHECKPOINTED_OK),
        ("counts w_gate's and w_up's shared input twice", '''
def activation_bytes_per_layer(batch_size, seq_len, n_embd, n_head, ffn_hidden):
    return batch_size * seq_len * (9 * n_embd + 4 + n_head * seq_len + 4 * ffn_hidden) * 4
''' + _CHECKPOINTED_OK),
        ("with checkpointing keeps every block's activations anyway (the estimate does not change)", '''
def activation_bytes_per_layer(batch_size, seq_len, n_embd, n_head, ffn_hidden):
    return batch_size * seq_len * (8 * n_embd + 4 + n_head * seq_len + 4 * ffn_hidden) * 4


def checkpointed_bytes_per_layer(batch_size, seq_len, n_embd, n_head, ffn_hidden):
    return activation_bytes_per_layer(batch_size, seq_len, n_embd, n_head, ffn_hidden)
'''),
    ],
}
