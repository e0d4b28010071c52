"""Peer-to-peer KV tier messages: the p2p tier actors of different hosts (``tiers.p2p.actor``).

A CPU tier's lookup that misses reaches its p2p tier, which asks every peer at once:

- ``PeerLookup(requester, session, layout, keys)`` published on ``subjects.tier_peers()``; every
  other p2p tier answers ``PeerHeld(peer, session, num_leading)`` on
  ``subjects.tier_peer_answers(requester)``: how many leading keys its own host's CPU tier
  holds, **pinned** for the session (none: 0, nothing pinned), and where its direct stream
  listens. The requester keeps the longest answer and ends the other sessions.
- ``PeerRead(session, index)`` → the session's ``index``-th chunk, its slot's bytes (every
  rank) as a raw reply in the secondary tiers' part format (``tiers.secondary.chunk_format``:
  header, key, payload, digest), or an error reply once the session is gone; on
  ``subjects.tier_peer_reads(peer)``. The requester keeps at most a window of reads in flight,
  and the bus carries a large reply in pulled chunks: nobody is flooded. Where the direct stream
  connects, the chunks come over it instead (``tiers.p2p.channel``).
- ``PeerDone(session)`` (published, no reply) on the same subject: unpin. A session never ended
  (its requester died) is ended by the peer after its time to live.
- ``PeerHello(peer)`` on ``subjects.tier_peers()`` when a p2p tier starts: the others answer
  ``PeerHeld(session="")``, and a round can end once every known peer answered.
"""

from __future__ import annotations

import msgspec

from shoal.bus.messages.offload import KVLayout


class PeerLookup(msgspec.Struct, tag="peer_lookup", array_like=True, omit_defaults=True):
    requester: str  # the asking p2p tier (it ignores its own lookup)
    session: str  # names the pins a peer takes for this lookup
    layout: KVLayout  # a peer whose host keeps another layout holds none of these
    keys: list[bytes]  # a request's chunk keys in prefix order


class PeerHello(msgspec.Struct, tag="peer_hello", array_like=True, omit_defaults=True):
    """A p2p tier that starts announces itself; every peer answers ``PeerHeld(session="")``,
    so each knows whom a lookup round waits for."""

    peer: str


class PeerHeld(msgspec.Struct, tag="peer_held", array_like=True, omit_defaults=True):
    peer: str
    session: str
    num_leading: int
    data_address: str = ""  # "host:port" of its direct stream (``tiers.p2p.channel``); "": none


class PeerRead(msgspec.Struct, tag="peer_read", array_like=True, omit_defaults=True):
    session: str
    index: int  # of the session's pinned keys


class PeerDone(msgspec.Struct, tag="peer_done", array_like=True, omit_defaults=True):
    session: str


PeerInbound = PeerRead | PeerDone
PeerBroadcast = PeerLookup | PeerHello
