"""The single controller in the user's process: Engine (the front door), its configuration tree, the controller loop, the frontend's outputs (delivery) and metrics. Imports worker and below."""
