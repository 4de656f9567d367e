"""Many instances as one service: data-parallel replicas on Ray Serve behind a router that knows
which replica holds which document (installed as ``hypic.cluster``)."""
