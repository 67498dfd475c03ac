"""The loading machinery, which knows no format.

- :mod:`.inplace`: loads into tensors that exist already, planned over a
  checkpoint opened as a mapped view (``ckptio.formats.mapped``);
- :mod:`.sharing`: loads where every rank of a process group gets the whole
  checkpoint and each byte is read from storage once, shared over collectives.
"""
