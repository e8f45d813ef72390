// What a replay's value is, against a real idemreg serve: the default
// codec's is JSON.parse's value, whatever once<T>() says; jsonCodecOf
// turns it back into a T.
import assert from "node:assert/strict";
import { after, before, test } from "node:test";
import { jsonCodec, jsonCodecOf } from "../src/index.js";
import { startRegistry, type Registry } from "./registry.js";

let reg: Registry;
before(async () => {
  reg = await startRegistry();
});
after(async () => {
  await reg?.stop();
});

interface Charge {
  id: string;
  at: Date;
}

const at = new Date("2026-12-05T10:00:00.000Z");
const charge = async (): Promise<Charge> => ({ id: "ch_1", at });

test("the default codec replays JSON.parse's value: a Date comes back its ISO string", async () => {
  const k = { consumer: "ts.codec", key: `default-${process.pid}` };
  const first = await reg.client.once<Charge>(k, charge);
  assert.ok(first.ran);
  assert.ok(first.value.at instanceof Date, "the run's own value is the handler's");
  const again = await reg.newClient().once<Charge>(k, charge);
  assert.ok(again.replayed);
  assert.equal(typeof again.value.at, "string", "typed Date, but JSON.parse's string");
  assert.equal(again.value.at as unknown, "2026-12-05T10:00:00.000Z");
});

test("jsonCodecOf(revive) replays a T, and reads what jsonCodec stored", async () => {
  const chargeCodec = jsonCodecOf((j): Charge => {
    const o = j as { id: string; at: string };
    return { id: o.id, at: new Date(o.at) };
  });
  const k = { consumer: "ts.codec", key: `typed-${process.pid}` };
  const first = await reg.client.once(k, charge, { codec: chargeCodec });
  assert.ok(first.ran);
  const again = await reg.newClient().once(k, charge, { codec: chargeCodec });
  assert.ok(again.replayed);
  assert.ok(again.value.at instanceof Date, "revived");
  assert.equal(again.value.at.getTime(), at.getTime());
  assert.equal(again.value.id, "ch_1");

  // The same bytes and type as jsonCodec: a record either wrote replays
  // with the other.
  assert.equal(chargeCodec.type, jsonCodec.type);
  const plain = await reg.newClient().once(k, charge);
  assert.deepEqual(plain.value, { id: "ch_1", at: "2026-12-05T10:00:00.000Z" });
});

test("jsonCodecOf passes a reviver to JSON.parse", async () => {
  const iso = /^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$/;
  const dates = jsonCodecOf(
    (j) => j as Charge,
    (_k, v) => (typeof v === "string" && iso.test(v) ? new Date(v) : v),
  );
  const k = { consumer: "ts.codec", key: `reviver-${process.pid}` };
  await reg.client.once(k, charge, { codec: dates });
  const again = await reg.newClient().once(k, charge, { codec: dates });
  assert.ok(again.replayed);
  assert.ok(again.value.at instanceof Date);
});
