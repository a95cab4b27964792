"""The torchx component refuses a secret in `env` by its name and by its value (issue 38,
finding 12): the sbatch script's `srun --export` line and the pod spec show env to whoever can
read the job. Ordinary values pass, and `allow_env` lets a named false alarm through. The
keys below are made up here, in the shape of each vendor's."""

import random
import string
import subprocess
import sys
from pathlib import Path

import pytest

from launch.component import train
from trainer.credentials import is_secret_name, secret_kind

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SEED = random.Random(38)
ALNUM = string.ascii_letters + string.digits


def made_up(alphabet: str, n: int) -> str:
    return "".join(SEED.choice(alphabet) for _ in range(n))


def refusal(name: str, why: str) -> str:
    return (f"env {name}: a secret in env would be written into the job spec; give it through the scheduler's "
            "secret mechanisms instead: a Kubernetes Secret, a Slurm environment file (exported in the shell that "
            f"submits), or an instance role ({why}; if it is no secret, pass --allow_env {name})")


def refused(env: dict, **kwargs) -> str:
    with pytest.raises(ValueError) as e:
        train(env=env, **kwargs)
    assert not any(v in str(e.value) for v in env.values())  # the value is never shown
    return str(e.value)


@pytest.mark.parametrize("name", ["WANDB_KEY", "PGPASSWORD", "MYSQL_PWD", "GH_TOKEN", "GITLABTOKEN", "DJANGO_SECRET",
                                  "CLIENTSECRET_VALUE", "SSH_KEY", "KEY", "REDIS_PASSWORD_ENC", "VAULT_PASSPHRASE",
                                  "HF_TOKEN", "OPENAI_API_KEY", "AWS_SECRET_ACCESS_KEY"])
def test_secret_names_are_refused(name):
    assert refused({"LOGLEVEL": "INFO", name: "x1"}) == refusal(name, "its name says so")


AWS_ID = made_up(string.ascii_uppercase + string.digits, 16)
KEYS = {
    "an AWS access key ID": ["AKIA" + AWS_ID, "ASIA" + AWS_ID, "--key=AKIA" + AWS_ID + ",region=x"],
    "a GitHub token": ["ghp_" + made_up(ALNUM, 36), "gho_" + made_up(ALNUM, 36), "ghs_" + made_up(ALNUM, 36),
                       "github_pat_" + made_up(ALNUM, 22) + "_" + made_up(ALNUM, 59)],
    "a Slack token": [f"xox{c}-{made_up(string.digits, 11)}-{made_up(ALNUM, 24)}" for c in "bpas"],
    "an API key (sk-...)": ["sk-" + made_up(ALNUM, 48), "sk-proj-" + made_up(ALNUM + "_-", 64)],
    "a GitLab token": ["glpat-" + made_up(ALNUM + "_-", 20)],
    "a Google API key": ["AIza" + made_up(ALNUM + "_-", 35)],
    "a Hugging Face token": ["hf_" + made_up(ALNUM, 34)],
    "a JSON Web Token": ["eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJyYW5rbWl4In0." + made_up(ALNUM + "_-", 43)],
    "a private key": ["-----BEGIN RSA PRIVATE KEY-----\nMIIEow...", "-----BEGIN OPENSSH PRIVATE KEY-----",
                      "-----BEGIN PRIVATE KEY-----"],
    "credentials in a URI": ["postgres://rankmix:hunter2@db.example.com/runs", "s3://AKID:s3cr3t@bucket/train"],
}


@pytest.mark.parametrize("kind,value", [(k, v) for k, values in KEYS.items() for v in values])
def test_keys_of_known_formats_are_refused_under_any_name(kind, value):
    assert refused({"LOGLEVEL": "INFO", "JOB_OPTS": value}) == refusal("JOB_OPTS", f"its value looks like {kind}")


@pytest.mark.parametrize("alphabet,length", [(ALNUM + "+/", 40), (ALNUM, 32), (ALNUM + "-_", 43), (ALNUM, 64)])
def test_random_keys_are_refused_by_their_entropy(alphabet, length):
    keys = [made_up(alphabet, length) for _ in range(500)]
    caught = [k for k in keys if secret_kind(k) == "a random key (a long string of high entropy)"]
    assert len(caught) >= 0.95 * len(keys)  # random: a few read as words, or start with '/' as a path does
    key = next(iter(caught))
    assert refused({"OTHER": key}) == refusal("OTHER", "its value looks like a random key (a long string of high "
                                              "entropy)")


ORDINARY = {
    # paths, URLs without user-info, hosts, numbers
    "DATA": "/shared/data/criteo_1tb/day_0-00000.parquet",
    "CACHE": "/home/JohnSmith/Projects/RankMix2024/runs/ablation_v3/Step1000",
    "RELATIVE": "torch/include/ATen/ops/max_pool3d_with_indices_backward.h",
    "LD_LIBRARY_PATH": "/usr/local/cuda-12.4/lib64:/usr/lib/x86_64-linux-gnu:/opt/conda/lib",
    "TRAIN_URI": "s3://my-bucket/logs/2024/01/part-00000-3f2a1b4c-5d6e-7f80-9a1b-2c3d4e5f6a7b-c000.snappy.parquet",
    "MLFLOW_TRACKING_URI": "https://mlflow.internal.example.com:5000/api/2.0/mlflow?experiment=RankMixerCriteo1TB",
    "AWS_ENDPOINT_URL": "http://minio.storage.svc.cluster.local:9000",
    "MASTER_ADDR": "gpu-node-0042.rack17.datacenter-west.example.com",
    "MASTER_PORT": "29500",
    "SEED": "12345678901234567890123456789012345678",
    "LR": "3.0000000000000001e-04",
    # NCCL and torch settings
    "NCCL_SOCKET_IFNAME": "^docker0,lo", "NCCL_IB_HCA": "mlx5_0:1,mlx5_1:1,mlx5_2:1,mlx5_3:1",
    "NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,GRAPH,ENV,TUNING", "NCCL_IB_PKEY": "0x8001",
    "NCCL_TOPO_FILE": "/etc/nccl/topo.xml", "NCCL_ALGO": "Ring,Tree", "NCCL_P2P_LEVEL": "NVL",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7",
    # what rankmix, its sweep and torchx's ddp set
    "LOGLEVEL": "WARNING", "TORCHX_TRACKING_EXPERIMENT_NAME": "default-experiment", "OMP_NUM_THREADS": "1",
    "PYTHONPATH": "/work/rankmix:/opt/venv/lib/python3.11/site-packages", "TORCH_FORCE_WEIGHTS_ONLY_LOAD": "1",
    "AWS_EC2_METADATA_DISABLED": "true", "AWS_PROFILE": "prod", "AWS_REGION": "eu-west-1",
    "AWS_ACCESS_KEY_ID": "AKID", "TORCH_DISTRIBUTED_DEBUG": "DETAIL", "TORCH_SHOW_CPP_STACKTRACES": "1",
    "TOKENIZERS_PARALLELISM": "false", "AWS_WEB_IDENTITY_TOKEN_FILE": "/var/run/secrets/eks.amazonaws.com/token",
    "GOOGLE_APPLICATION_CREDENTIALS": "/var/run/secrets/gcp/key.json", "SECRETS_DIR": "/run/secrets",
    # names: digests, ids, images, models, CamelCase
    "GIT_COMMIT": "fa6f158b2c7e4d1a9e0b3c5d7f9a1b2c3d4e5f60",
    "MODEL_SHA256": "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08",
    "RUN_ID": "3f2a1b4c-5d6e-7f80-9a1b-2c3d4e5f6a7b",
    "IMAGE": "registry.example.com/team/rankmix:2024-06-01-cuda12.4@sha256:" + "ab12" * 16,
    "MODEL": "meta-llama/Llama-3.1-8B-Instruct-FP8-dynamic-128k",
    "EXPERIMENT": "RankMixer_Criteo1TB_D512_L8_T16_lr3e-4_bs65536_seed42",
    "HANDLER": "TorchElasticWorkerGroupSpecHandlerV2Configuration",
    "ALPHABET": "ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789",
    "EXTRA_ARGS": "--data.cache_dir=/shared/cache --train.steps=100000 --model.hidden_dim=512",
}


def test_ordinary_values_pass_into_the_job_spec():
    assert [(n, secret_kind(v)) for n, v in ORDINARY.items() if secret_kind(v)] == []
    assert [n for n in ORDINARY if is_secret_name(n)] == []
    env = train(env=dict(ORDINARY)).roles[0].env
    assert {n: env[n] for n in ORDINARY} == ORDINARY


def test_allow_env_lets_one_named_variable_through():
    github = KEYS["a GitHub token"][0]
    app = train(env={"PARTITION_KEY": "hour", "BUILD_TAG": github}, allow_env=["PARTITION_KEY", "BUILD_TAG"])
    env = app.roles[0].env
    assert (env["PARTITION_KEY"], env["BUILD_TAG"]) == ("hour", github)
    # only the variables it names
    assert refused({"PARTITION_KEY": "hour", "WANDB_KEY": "x1"}, allow_env=["PARTITION_KEY"]) == \
        refusal("WANDB_KEY", "its name says so")


def dryrun(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "torchx"), "run", "--workspace", "", "--dryrun", "-s", "slurm",
                           "launch/component.py:train", *args], cwd=REPO, capture_output=True, text=True, timeout=300)


def test_torchx_refuses_a_key_under_any_name_and_takes_allow_env():
    key = KEYS["a Slack token"][0]
    proc = dryrun("--env", f"LOGLEVEL=INFO,NOTIFY={key}")
    assert proc.returncode != 0 and refusal("NOTIFY", "its value looks like a Slack token") in proc.stderr
    assert key not in proc.stdout + proc.stderr
    proc = dryrun("--env", "LOGLEVEL=INFO,SORT_KEY=hour,PGPASSWORD=1", "--allow_env", "SORT_KEY,PGPASSWORD")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "--export=ALL,LOGLEVEL=INFO,SORT_KEY=hour,PGPASSWORD=1," in proc.stdout
