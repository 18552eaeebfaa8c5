import torch

# The test machine is shared (2 cores, other jobs): a second intra-op thread mostly waits on a
# descheduled peer, so one thread is both faster and steadier, as in the servers themselves.
torch.set_num_threads(1)
