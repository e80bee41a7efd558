"""Tools around training: offline evaluation, μP coordinate check and lr sweep, the compute planner."""
