"""What paired expert weight gradients' waiting rows add to a distributed rank's activation peak, in closed form.

Under `expert_wgrad_pairs` (`kernels.wgrad_pairs`) an expert backward of a layer leaves its rows' weight-gradient
operands waiting for the layer's next expert backward, whose launch runs both and frees them; an odd count's
last one leaves them waiting until the optimizer step. The runtime's memory check replays that op by op
(`runtime.activation_memory.replay_peak`'s `waits`); the planner prices thousands of candidates at once, so it
takes the replay's peak in closed form from the order the distributed schedules run (`runtime.schedule`):
every forward of a step before the first backward, then the backward layer by layer from the last, the m
micro-batches ascending within each, a colocated rank's expert backward of a (layer, micro-batch) just before
its attention backward.

Per MoE layer and micro-batch a rank keeps K (its expert rows; colocated also A, its attention side) until the
backward, an expert backward holds G (colocated an attention backward Ag) for its span, and leaves W waiting.
At the expert backward of micro-batch i of the j-th layer from the last (of n) the running sum is

    (n m - j m - i) K  +  (j s + i mod 2) W  +  G,      s = m mod 2 (an odd count's last rows stay),

largest at i = 0 or 1 and j = 0 or n - 1: the forms below. tests/placement/test_waiting_rows.py checks them
against the runtime's replay over many shapes. Torch-free (numpy arrays, one element per candidate).
"""

from __future__ import annotations

import numpy as np

from disagmoe.roofline.stages import Num


def _carried(waits: Num, kept_per_micro_batch: Num, layers: Num, micro_batches: Num) -> Num:
    """The most an odd count's rows left waiting by the layers already done add over the kept bytes those
    layers freed (`kept_per_micro_batch`: what one micro-batch of a layer frees): 0 unless the waits grow."""
    odd = np.asarray(micro_batches) % 2
    return np.maximum(0.0, (np.asarray(layers) - 1) * (odd * waits - micro_batches * kept_per_micro_batch))


def expert_rank_rise(kept: Num, waits: Num, layers: Num, micro_batches: Num, first: Num = 0.0) -> Num:
    """Bytes the waiting rows add to a disaggregated expert rank's peak, n m K + G unpaired (`kept` K and
    `waits` W per layer and micro-batch, over `layers` n and `micro_batches` m): the second backward of a layer
    holds the first one's rows where they outweigh what it freed (W > K), the first holds `first` E more over
    its own span (`roofline.memory.paired_first_held_bytes`: an operand it would have dropped part-way waits),
    and an odd count's rows pile up over the layers where they outweigh what the layers free (W > m K). 0 where
    `waits` and `first` are 0."""
    second = np.where(np.asarray(micro_batches) >= 2, np.maximum(0.0, waits - kept), 0.0)
    return np.maximum(first, second) + _carried(waits, kept, layers, micro_batches)


def colocated_rank_rise(kept_total: Num, attention_kept: Num, expert_kept: Num, attention_grad: Num,
                        expert_grad: Num, dense_first_backward: Num, head: Num, layers: Num, dense_layers: Num,
                        micro_batches: Num, waits: Num, first: Num = 0.0) -> Num:
    """Bytes the waiting rows add to a colocated rank's peak: its replay's peak with `waits` W less without.
    `kept_total` T: every layer's kept bytes after the last forward; per MoE layer and micro-batch
    `attention_kept` A, `expert_kept` K, `attention_grad` Ag and `expert_grad` G; `dense_first_backward`: the
    leading dense layers' kept bytes plus one dense backward's (their first backward, after every MoE layer's);
    `head`: the loss's peak (before any backward); `layers` n MoE layers and `dense_layers`; `first` E: what
    the first expert backward of a pair holds more over its own span (`expert_rank_rise`)."""
    m, per_micro_batch = np.asarray(micro_batches), attention_kept + expert_kept

    def peak(w: Num, e: Num) -> Num:
        carried = _carried(w, per_micro_batch, layers, m)
        second = np.where(m >= 2, np.maximum(0.0, w - per_micro_batch), 0.0)
        expert = kept_total + expert_grad + carried + np.maximum(e, second)  # a layer's first or second backward
        attention = kept_total - expert_kept + w + attention_grad + carried  # the first attention backward
        dense = np.where(np.asarray(dense_layers) > 0, dense_first_backward + layers * (m % 2) * w, 0.0)
        return np.maximum.reduce([kept_total + head, expert, attention, dense])

    return peak(waits, first) - peak(0.0 * waits, 0.0 * waits)
