"""Where ranks run and how the driver reaches them: joining Ray, placement, Ray actors or
plain processes (local / torchrun), the Job a driver steps, progress and faults.
May import every runtime package below it (train, lowering, execute) and piper."""
