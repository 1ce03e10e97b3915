"""On PYTHONPATH, every process of a run imports this at start: a DataLoader worker then hangs
before its first batch, as a worker stuck in a lock inherited from a fork would."""
import time

from torch.utils.data import get_worker_info

import data_stream

_batches = data_stream.BertPretrainStream.batches


def _hang(self, *args, **kwargs):
    if get_worker_info() is not None:
        time.sleep(3600)
    return _batches(self, *args, **kwargs)


data_stream.BertPretrainStream.batches = _hang
