"""The process's open-file limit, raised at a service's start: every connection to a listening port
holds a file descriptor, and the usual soft limit (1,024) would let a thousand idle connections stop
the service from accepting any more (or from opening a file). The hard limit is the most an
unprivileged process may raise it to."""
from __future__ import annotations

import logging
import resource

# Below this hard limit a warning says how to raise it: the listeners' own bounds (README, "Listener
# limits") assume room for thousands of connections.
LOW_OPEN_FILE_LIMIT = 8_192

logger = logging.getLogger(__name__)


def raise_open_file_limit() -> int:
    """Raises the soft RLIMIT_NOFILE to the hard limit; returns the soft limit now in force. Logs a
    warning (and changes nothing else) when the hard limit is below LOW_OPEN_FILE_LIMIT."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < LOW_OPEN_FILE_LIMIT:
        logger.warning("the open-file limit is %d (hard): each client connection holds one, so a few thousand "
                       "idle connections can stop this process from accepting more; raise it (ulimit -Hn, "
                       "systemd LimitNOFILE=, docker --ulimit nofile=)", hard)
    if soft == hard:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError) as error:  # e.g. an infinite hard limit some kernels refuse as a soft one
        logger.debug("cannot raise the open-file limit from %d to %d: %s", soft, hard, error)
        return soft
    return hard
