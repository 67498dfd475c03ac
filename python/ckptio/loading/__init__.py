"""The loading machinery, which knows no format.

- :mod:`.inplace`: loads into tensors that exist already, planned over a
  checkpoint opened as a mapped view (``ckptio.formats.mapped``);
- :mod:`.stored`: loads in place from an object store with no local copy
  (a checkpoint described on the meta device, each pair's bytes GET straight
  into its destination);
- :mod:`.sharing`: loads where every rank of a process group gets the whole
  checkpoint and each byte is read from storage once, shared over collectives.
"""
