"""Reading done messages in bursts.

A waiter takes every message that has arrived, then re-reads the jobs they name. Draining with
`get_message(timeout=0.0)` broke under load: when only part of a message has reached the socket,
redis-py (8.1) raises TimeoutError for the rest, reconnects and re-subscribes; the confirmations
of thousands of re-subscribed channels arrive in parts too, so its retries failed the same way and
the waiter died with a BrokerError (2,000 waiting jobs on Redis 6.2, every time). Here the rest
of a message gets a short time to arrive, and a read that still fails ends the burst and tells
the caller to re-read everything: a reconnect may have dropped messages.
"""

from __future__ import annotations

from typing import Any

import redis

# How long a burst waits for the next message (or the rest of one) before it ends.
BURST_GAP_S = 0.002


def read_burst(pubsub: redis.client.PubSub, timeout: float) -> tuple[list[dict[str, Any]], bool]:
    """Wait up to `timeout` s for a message, then take the ones right behind it. Returns the
    messages and whether the read was whole; False: a read timed out mid-message, so messages may
    have been lost (the caller should re-read the state of everything it waits for)."""
    messages: list[dict[str, Any]] = []
    wait = timeout
    try:
        while True:
            message = pubsub.get_message(timeout=wait)
            if message is None:
                return messages, True
            messages.append(message)
            wait = BURST_GAP_S
    except redis.TimeoutError:
        return messages, False
