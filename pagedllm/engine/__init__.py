"""Engine: input processing, the schedule -> execute -> update loop, output processing."""
