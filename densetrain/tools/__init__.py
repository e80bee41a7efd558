"""Tools around training: offline evaluation, the documents of a step (blame) and its replay verdict (data or
machine), the hardware health verdict (doctor), μP coordinate check and lr sweep, the compute planner."""
