/* The activations a variant selects with PIC_ACT, numbered for `#if PIC_ACT == ...` (picompile/
 * activations.py names them). Shared by ffn.c and ffn_cuda.cuh, spliced into both. */
#ifndef PICOMPILE_ACT_H
#define PICOMPILE_ACT_H
#define PIC_RELU 0
#define PIC_SILU 1
#define PIC_GELU 2
#define PIC_GELU_TANH 3
#define PIC_RELU2 4
/* act(v) == 0 exactly for v <= 0 (ReLU, squared ReLU): a zero gate makes h zero, up unread. */
#define PIC_ZERO_BELOW(act) ((act) == PIC_RELU || (act) == PIC_RELU2)
#endif
