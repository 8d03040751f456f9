"""Hand-written kernels behind the runtime's speed settings, each a torch.library custom op with a torch fallback.

    cross_entropy.py   loss_kernel: triton   the loss and its gradient in one kernel, in the forward
    add_layer_norm.py  fused_residual_norm   a residual add and the layer norm after it, one kernel each way
    fp8.py             fp8_lm_head           the lm_head's matrix products in FP8 with dynamic scales
    heads.py           the training forward's lm_head + loss, as the runtime chooses them (GPT.forward's loss_head)

model.py imports none of them: the training runtime (runtime/runtime.py) hands the model what it chose.
Each op runs its Triton kernel on a CUDA tensor where Triton is installed, and on a CPU tensor under
TRITON_INTERPRET=1 (Triton's interpreter: how the tests check the kernels without a GPU); anywhere else its
torch fallback computes the same outputs, so a run asked for a kernel still runs on a machine without one.
These modules import only torch and, where it is installed, triton.
"""
