"""The formats layer: what ckptio knows of each checkpoint format, one module each.

- :mod:`.torchzip`: torch.save's zip archives;
- :mod:`.safetensors`: safetensors files and the hub's sharded layout;
- :mod:`.dcp`: ``torch.distributed.checkpoint`` items and ``.metadata``;
- :mod:`.detect`: the one format detection, from the content;
- :mod:`.mapped`: a checkpoint opened as a mapped view, what every format's
  reader hands on; :mod:`.unpickled`: the tensors of a natively read pickle.

Each format opens a checkpoint one way, which every loader, ``describe``,
``verify`` and ``convert`` use. Nothing here moves tensor bytes: the I/O layer
below does.
"""
