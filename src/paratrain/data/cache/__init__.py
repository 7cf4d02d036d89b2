"""KINDS: a decoded-image cache kind's name -> what it keeps. Nothing else lives here.

The decoded-image cache keeps every image decoded once, resized, on local disk. A kind is
``paratrain.data.cache.<name>.KIND`` (a :class:`~paratrain.data.cache.base.CacheKind`: how
it is keyed, sized, laid out, written and read), loaded by ``base.kind``. ``--cache auto``
tries the kinds in this order and takes the first that fits. The machinery around them
is one module per job: ``choose`` (plan: which kind, how large, ready or to build),
``build`` (every node's build, under a lock, into a folder renamed into place),
``verify`` (the manifest, the cheap checks at start, the checksums in the background)
and ``read`` (a built cache's images, and the datasets over it). Adding a kind is its
module and one line here; nothing here imports numpy or torch.
"""

from __future__ import annotations

KINDS: dict[str, str] = {
    "raw": "HWC uint8 pixels in one memory-mapped file: nothing to decode, bit for bit the "
    "decode path's evaluation input, as large as the pixels",
    "packed": "each image re-encoded as a JPEG at quality 90 in a few large files with an "
    "index (as FFCV keeps ImageNet): several times faster to decode than the originals",
    "zlib": "each image's pixels deflated into a few large files: lossless, smaller than raw "
    "where images have flat regions (only when named)",
}

MODES: dict[str, str] = {
    "auto": "the first kind that fits (of raw and packed): raw within --cache-max-gb, else packed where the "
    "disk has room, else off",
    "on": "raw",
    **KINDS,
    "off": "decode every image every epoch",
}
