// once() and the typed client against a real idemreg serve, over gRPC
// (connect-node's grpc transport, h2c).
import assert from "node:assert/strict";
import { after, before, describe, test } from "node:test";
import { create } from "@bufbuild/protobuf";
import { Code } from "@connectrpc/connect";
import {
  ErrorReason,
  IdemregError,
  InProgressError,
  Kind,
  Outcome,
  ParkedError,
  ResultSchema,
  RegistryClient,
  State,
  StoredFailureError,
  UnavailableError,
  bytesCodec,
  final,
  isFinal,
  isReason,
  type Attempt,
} from "../src/index.js";
import { createConnectTransport, createGrpcWebTransport } from "@connectrpc/connect-node";
import { createNodeTransport } from "../src/node.js";
import { startRegistry, type Registry } from "./registry.js";

let reg: Registry;
before(async () => {
  reg = await startRegistry();
});
after(async () => {
  await reg?.stop();
});

let n = 0;
/** A fresh key, so that the tests share one registry without sharing keys. */
function key(consumer = "ts.payments") {
  return { consumer, key: `msg-${process.pid}-${++n}` };
}

/** A promise and its resolver: a gate a handler waits on. */
function gate<T = void>() {
  let open!: (v: T) => void;
  const p = new Promise<T>((r) => (open = r));
  return { p, open };
}

describe("once", () => {
  test("runs the handler once and replays its value to duplicates", async () => {
    const k = key();
    let runs = 0;
    let seen: Attempt | undefined;
    const handler = async (a: Attempt) => {
      runs++;
      seen = a;
      return { charged: 42 };
    };
    const first = await reg.client.once(k, handler);
    assert.equal(first.ran, true);
    assert.equal(first.replayed, false);
    assert.deepEqual(first.value, { charged: 42 });
    assert.equal(first.record?.state, State.COMPLETED);
    assert.ok(seen && seen.token > 0n);
    assert.equal(seen?.attempt, 1n);
    assert.equal(seen?.key.kind, Kind.MESSAGE);

    for (let i = 0; i < 3; i++) {
      const again = await reg.newClient().once(k, handler);
      assert.equal(again.ran, false);
      assert.equal(again.replayed, true);
      assert.deepEqual(again.value, { charged: 42 });
    }
    assert.equal(runs, 1);
    const rec = await reg.client.lookup(k);
    assert.equal(rec?.result?.outcome.case, "response");
    assert.equal(rec?.result?.outcome.case === "response" && rec.result.outcome.value.type, "application/json");
  });

  test("bytesCodec stores the bytes as they are, as the Go client's Once does", async () => {
    const k = key();
    const res = await reg.client.once(k, async () => new TextEncoder().encode("applied"), { codec: bytesCodec });
    assert.equal(new TextDecoder().decode(res.value), "applied");
    const rec = await reg.client.lookup(k);
    assert.ok(rec?.result?.outcome.case === "response");
    assert.equal(new TextDecoder().decode(rec.result.outcome.value.data), "applied");
    assert.equal(rec.result.outcome.value.type, "");
  });

  test("a throw releases the key: the retry runs, as attempt 2", async () => {
    const k = key();
    const attempts: bigint[] = [];
    await assert.rejects(
      reg.client.once(k, async (a) => {
        attempts.push(a.attempt);
        throw new Error("downstream timed out");
      }),
      /downstream timed out/,
    );
    const res = await reg.client.once(k, async (a) => {
      attempts.push(a.attempt);
      return "ok";
    });
    assert.equal(res.ran, true);
    assert.deepEqual(attempts, [1n, 2n]);
  });

  test("a final failure is stored and replayed as a StoredFailureError", async () => {
    const k = key();
    let runs = 0;
    const handler = async () => {
      runs++;
      throw final(new Error("card declined"), Code.FailedPrecondition);
    };
    await assert.rejects(reg.client.once(k, handler), (e) => isFinal(e) && /card declined/.test((e as Error).message));
    const replayed = await reg.client.once(k, handler).then(
      () => assert.fail("a stored failure must be thrown"),
      (e) => e,
    );
    assert.ok(replayed instanceof StoredFailureError);
    assert.equal(replayed.code, Code.FailedPrecondition);
    assert.equal(replayed.message, "card declined");
    assert.ok(isFinal(replayed));
    assert.equal(runs, 1);
  });

  test("a duplicate while the first runs gets InProgressError, or the outcome with waitMs", async () => {
    const k = key();
    const entered = gate();
    const finish = gate();
    let runs = 0;
    const first = reg.client.once(k, async () => {
      runs++;
      entered.open();
      await finish.p;
      return "first";
    });
    await entered.p;
    const other = reg.newClient();
    const err = await other.once(k, async () => "duplicate").then(
      () => assert.fail("the duplicate ran"),
      (e) => e,
    );
    assert.ok(err instanceof InProgressError);
    assert.equal(err.reason, "IN_PROGRESS");
    assert.ok(err.retryAfterMs > 0);

    const waiting = other.once(k, async () => "duplicate", { waitMs: 20_000 });
    // The waiting duplicate holds a Claim in the registry; the first ends.
    setTimeout(() => finish.open(), 100);
    const [a, b] = await Promise.all([first, waiting]);
    assert.equal(a.value, "first");
    assert.equal(b.replayed, true);
    assert.equal(b.value, "first");
    assert.equal(runs, 1);
  });

  test("the lease is extended while the handler runs, so no one takes the key over", async () => {
    const k = key();
    const entered = gate<Attempt>();
    const finish = gate();
    const first = reg.client.once(
      k,
      async (a) => {
        entered.open(a);
        await finish.p;
        return a.signal.aborted;
      },
      { leaseMs: 200 },
    );
    const a = await entered.p;
    assert.ok(a.token > 0n);
    const before = await reg.client.lookup(k);
    const startExpiry = before!.leaseExpiresAt!.seconds * 1000n + BigInt(before!.leaseExpiresAt!.nanos) / 1_000_000n;
    // Three leases later the key is still held, by the first attempt.
    const guard = Date.now() + 30_000; // a hang guard, not a timing check
    for (;;) {
      assert.ok(Date.now() < guard, "the lease was not extended");
      const rec = await reg.client.lookup(k);
      const exp = rec!.leaseExpiresAt!.seconds * 1000n + BigInt(rec!.leaseExpiresAt!.nanos) / 1_000_000n;
      if (exp > startExpiry + 600n) {
        assert.equal(rec!.state, State.IN_PROGRESS);
        assert.equal(rec!.attempt, 1n, "held by the first attempt all along");
        break;
      }
      await new Promise((r) => setTimeout(r, 20));
    }
    await assert.rejects(reg.newClient().once(k, async () => "takeover"), InProgressError);
    finish.open();
    const res = await first;
    assert.equal(res.value, false, "the handler's signal was not aborted");
  });

  test("a parked key is a ParkedError and the handler does not run", async () => {
    const k = key();
    const cl = await reg.client.claim(k, { leaseMs: 5000 });
    assert.equal(cl.outcome, Outcome.ACQUIRED);
    await reg.client.park(k, { token: cl.token, claimSecret: cl.claimSecret }, "outcome unknown");
    const err = await reg.client.once(k, async () => assert.fail("ran")).then(
      () => assert.fail("no error"),
      (e) => e,
    );
    assert.ok(err instanceof ParkedError);
    assert.equal(err.record.parkReason, "outcome unknown");
    assert.ok(isReason(err, ErrorReason.PARKED));
  });
});

describe("typed errors from ErrorInfo", () => {
  test("another fingerprint is FINGERPRINT_MISMATCH", async () => {
    const k = key();
    await reg.client.once(k, async () => 1, { fingerprint: new Uint8Array([1]) });
    const err = await reg.client.once(k, async () => 2, { fingerprint: new Uint8Array([2]) }).then(
      () => assert.fail("no error"),
      (e) => e,
    );
    assert.ok(err instanceof IdemregError);
    assert.equal(err.code, Code.FailedPrecondition);
    assert.ok(isReason(err, ErrorReason.FINGERPRINT_MISMATCH));
  });

  test("an invalid key is INVALID_ARGUMENT with a field violation on key", async () => {
    const err = await reg.client.once({ consumer: "ts.payments", key: "k".repeat(300) }, async () => 1).then(
      () => assert.fail("no error"),
      (e) => e,
    );
    assert.ok(err instanceof IdemregError);
    assert.equal(err.code, Code.InvalidArgument);
    assert.ok(isReason(err, ErrorReason.INVALID_ARGUMENT));
    assert.equal(err.fieldViolations[0]?.field, "key");
  });

  test("a forged claim secret is CLAIM_SECRET_INVALID; another token LEASE_LOST", async () => {
    const k = key();
    const cl = await reg.client.claim(k, { leaseMs: 5000 });
    const forged = await reg.client
      .complete(
        k,
        { token: cl.token, claimSecret: new Uint8Array(cl.claimSecret.length) },
        create(ResultSchema, { outcome: { case: "response", value: { type: "", data: new Uint8Array() } } }),
      )
      .then(
        () => assert.fail("no error"),
        (e) => e,
      );
    assert.ok(isReason(forged, ErrorReason.CLAIM_SECRET_INVALID), String(forged));
    const stale = await reg.client.extend(k, { token: cl.token - 1n, claimSecret: cl.claimSecret }, 1000).then(
      () => assert.fail("no error"),
      (e) => e,
    );
    assert.ok(isReason(stale, ErrorReason.LEASE_LOST) || isReason(stale, ErrorReason.CLAIM_SECRET_INVALID), String(stale));
  });

  test("a registry that cannot be reached is an UnavailableError, and the handler does not run", async () => {
    const dead = new RegistryClient(createNodeTransport({ baseUrl: "http://127.0.0.1:1" }));
    let ran = false;
    const err = await dead
      .once(key(), async () => {
        ran = true;
      })
      .then(
        () => assert.fail("no error"),
        (e) => e,
      );
    assert.ok(err instanceof UnavailableError, String(err));
    assert.equal(ran, false);
  });

  test("a token is refused over plaintext unless allowed", () => {
    assert.throws(() => createNodeTransport({ baseUrl: "http://127.0.0.1:1", token: "t" }), /TLS only/);
    assert.throws(() => createNodeTransport({ baseUrl: "https://x", token: "t\n" }), /printable/);
    createNodeTransport({ baseUrl: "http://127.0.0.1:1", token: "t", allowInsecureToken: true });
  });
});

// The protocols a browser speaks (Connect, gRPC-Web, over HTTP/1.1), which
// the registry answers on its gRPC port beside gRPC: connect-node's
// transports for them stand in for connect-web's, which take the same
// options.
describe("Connect and gRPC-Web transports (HTTP/1.1)", () => {
  for (const [name, make] of [
    ["Connect, JSON", () => createConnectTransport({ baseUrl: reg.baseUrl, httpVersion: "1.1" })],
    ["Connect, binary", () => createConnectTransport({ baseUrl: reg.baseUrl, httpVersion: "1.1", useBinaryFormat: true })],
    ["gRPC-Web", () => createGrpcWebTransport({ baseUrl: reg.baseUrl, httpVersion: "1.1" })],
  ] as const) {
    test(`${name}: once runs, replays, and errors keep their ErrorInfo`, async () => {
      const c = new RegistryClient(make());
      const k = key();
      let runs = 0;
      const first = await c.once(k, async () => ++runs, { fingerprint: new Uint8Array([1]) });
      const again = await c.once(k, async () => ++runs, { fingerprint: new Uint8Array([1]) });
      assert.equal(first.ran, true);
      assert.equal(again.replayed, true);
      assert.equal(again.value, 1);
      const err = await c.once(k, async () => ++runs, { fingerprint: new Uint8Array([2]) }).then(
        () => assert.fail("no error"),
        (e) => e,
      );
      assert.ok(isReason(err, ErrorReason.FINGERPRINT_MISMATCH), String(err));
      assert.equal(runs, 1);
    });
  }
});
