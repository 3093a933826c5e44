"""The providers a machine is rented from, one small module each behind one interface (base.Provider),
like SkyPilot's sky/provision/<cloud>/: detect where this machine is (detect.py: env, then DMI;
nothing on a plain machine), connect with its credential, describe what a stop means there and what
still bills, and stop, terminate and read back the state (stop.carry confirms it).

Called this version: runpod, vast, lambda_cloud, aws (boto3), gcp, azure. Found and warned about
only: oci, nebius, digitalocean, hetzner (warn_only.py). docs/providers.md has the table;
stop.resolve holds the registry and decides, once, what stop.action means here.
"""
