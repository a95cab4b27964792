"""The MovieLens converter on ids near 2^63: no array sized by the largest id, and the same
output as for small ids, ids aside."""

from __future__ import annotations

import random
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from cli import rankmix
from trainer.offline.movielens import convert_movielens

USERS, ITEMS, RATINGS = 12, 15, 300
GENRES = ["Action", "Comedy", "Drama", "Horror", "Romance"]
OCCUPATIONS = ["artist", "doctor", "student"]


def huge(small: int) -> int:
    """Small id -> an id near 2^63, spread and in the same order (the converter breaks ties
    by id, so only an order-keeping map can give the same rows)."""
    return 2**63 - 2**52 * (100 - small)


def write_movielens(folder: Path, to_id=lambda i: i) -> Path:
    """A small ml-100k folder; `to_id` maps every user and item id. Timestamps tie often, some
    items have no year, a zip code is Canadian, and user 3's second line overrides its first."""
    rng = random.Random(7)
    folder.mkdir()
    users = [(u, rng.randint(1, 70), rng.choice("MF"), rng.choice(OCCUPATIONS), rng.choice(["12345", "T8H1N"]))
             for u in range(1, USERS + 1)] + [(3, 40, "F", "doctor", "54321")]
    (folder / "ml-100k.user").write_text("user_id:token\tage:token\tgender:token\toccupation:token\tzip_code:token\n" +
                                         "".join(f"{to_id(u)}\t{a}\t{g}\t{o}\t{z}\n" for u, a, g, o, z in users))
    items = [(i, rng.choice(["1950", "1995", "unknown"]), " ".join(rng.sample(GENRES, rng.randint(0, 3))))
             for i in range(1, ITEMS + 1)]
    (folder / "ml-100k.item").write_text("item_id:token\tmovie_title:token_seq\trelease_year:token\t"
                                         "class:token_seq\n" +
                                         "".join(f"{to_id(i)}\tTitle {i}\t{y}\t{g}\n" for i, y, g in items))
    ratings = [(rng.randint(1, USERS), rng.randint(1, ITEMS), rng.randint(1, 5),
                880_000_000 + rng.randint(0, 40) * 3_600)
               for _ in range(RATINGS)]
    (folder / "ml-100k.inter").write_text("user_id:token\titem_id:token\trating:float\ttimestamp:float\n" +
                                          "".join(f"{to_id(u)}\t{to_id(i)}\t{r}\t{t}\n" for u, i, r, t in ratings))
    return folder


def _split(out: Path, split: str) -> pa.Table:
    return pa.concat_tables([pq.read_table(p) for p in sorted((out / split).glob("part-*.parquet"))])


def _mapped(table: pa.Table) -> pa.Table:
    """`table` with its user, item and history ids mapped by `huge`."""
    for name in ("user_id", "item_id", "hist_items"):
        column = table.column(name).combine_chunks()
        ids = column.flatten() if name == "hist_items" else column
        mapped = pa.array([huge(i) for i in ids.to_pylist()], pa.int64())
        if name == "hist_items":
            mapped = pa.ListArray.from_arrays(column.offsets, mapped)
        table = table.set_column(table.schema.get_field_index(name), name, mapped)
    return table


def test_ids_near_2_63_give_the_small_ids_output(tmp_path):
    small = convert_movielens(write_movielens(tmp_path / "small"), tmp_path / "small_out", row_group_size=64)
    big = convert_movielens(write_movielens(tmp_path / "big", huge), tmp_path / "big_out", row_group_size=64)
    assert {k: v for k, v in big.items() if k != "files"} == {k: v for k, v in small.items() if k != "files"}
    assert small["num_users"] == USERS and small["num_items"] == ITEMS
    for split in ("train", "valid"):
        expected, got = _mapped(_split(tmp_path / "small_out", split)), _split(tmp_path / "big_out", split)
        assert got.num_rows == expected.num_rows > 0
        assert got.equals(expected), split
    assert pc.max(_split(tmp_path / "big_out", "train").column("user_id")).as_py() > 2**62
    # the later line of user 3 is the one used
    train = _split(tmp_path / "small_out", "train")
    assert set(train.filter(pc.equal(train.column("user_id"), 3)).column("user_zip").to_pylist()) == {6}


def test_an_id_beyond_int64_is_one_line(tmp_path):
    src = write_movielens(tmp_path / "ml", huge)
    text = (src / "ml-100k.item").read_text().replace(f"\n{huge(2)}\t", f"\n{2**63}\t")
    (src / "ml-100k.item").write_text(text)
    proc = rankmix("data", "movielens", "--src", str(src), "--out", str(tmp_path / "o"))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == f"rankmix: error: {src / 'ml-100k.item'}:3: malformed line: item_id='{2**63}'"
    assert "Traceback" not in proc.stderr


def test_a_rating_of_an_unknown_huge_id_is_one_line(tmp_path):
    src = write_movielens(tmp_path / "ml", huge)
    with open(src / "ml-100k.inter", "a") as f:
        f.write(f"{huge(1)}\t{2**63 - 1}\t4\t880000000\n")
    proc = rankmix("data", "movielens", "--src", str(src), "--out", str(tmp_path / "o"))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == (f"rankmix: error: {src / 'ml-100k.inter'}: rating row {RATINGS + 1} has "
                                   f"item_id={2**63 - 1} with no features")
    assert "Traceback" not in proc.stderr
