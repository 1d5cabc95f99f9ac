"""Protocol buffers of the swarm wire protocol (package ``swarm.v1``)."""
