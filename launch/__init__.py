"""The command line and the process entry points: above both services and offline/."""
