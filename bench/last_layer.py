"""
pretrain_ddp.py with its last layer computed for every token, what the heads read taken after it: the other
side of an A/B of the last-layer trick (issue 37), the same math.

    python bench/packing.py --sizes mini --seq-lens 128 --a "" --b "" --b-script bench/last_layer.py
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import model as M  # noqa: E402
import pretrain_ddp as P  # noqa: E402

subset_layer = M.Pretraining.layer


def full_layer(self, layer, x, rows, real_pos, mask, reads=None):
    out = subset_layer(self, layer, x, rows, real_pos, mask)
    return out if reads is None else out.index_select(0, reads)


if __name__ == "__main__":
    M.Pretraining.layer = full_layer
    P.cli()
