"""Process groups, environment detection, collectives and launching."""
