"""Building blocks of :class:`~lmcache_core.TieredHierarchy`.

``tier`` wraps one backend with failure isolation, deadlines and statistics; ``writer``
runs its bounded background-store queue; ``staging`` recycles the buffers that carry
chunks to background stores; ``admission`` counts sightings; ``health`` the retry
backoff; ``leases`` the pins taken by lookups.
"""
